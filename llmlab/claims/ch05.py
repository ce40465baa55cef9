"""Chapter 5's claims (§5, hardware), computed: the material's GPU table against the spec sheet (C14), and its
network advice priced by the α-β model (C15)."""

from __future__ import annotations

from llmlab import flops
from llmlab.claims import Measurement, register
from llmlab.dist import cost
from llmlab.hardware import SPECS, material

__all__ = ["gpu_table", "network_advice"]


@register("C14", chapter=5)
def gpu_table() -> Measurement:
    cells = material.check_table()
    counts = {v: sum(c.verdict == v for c in cells) for v in ("right", "misleading", "wrong")}
    flagged = [f"{c.gpu} {c.column} {c.material:g}: {c.note}" for c in cells if c.verdict != "right"]
    return Measurement(
        value=counts, unit="cells",
        text=f"{counts['right']} of {len(cells)} cells right as printed; " + "; ".join(flagged),
        device="computed", verdict="wrong" if counts["wrong"] else "misleading" if counts["misleading"] else "holds")


@register("C15", chapter=5)
def network_advice() -> Measurement:
    s, links, node_links, network_links = cost.C15_STEP, cost.LINKS, cost.NODE_LINKS, cost.NETWORK_LINKS
    node = cost.gradient_allreduce_times(s["n_params"], s["node_gpus"], s["bytes_per_param"])
    network = cost.gradient_allreduce_times(s["n_params"], s["cluster_gpus"], s["bytes_per_param"])
    compute = flops.training_flops(s["n_params"], s["tokens"]) / (
        s["cluster_gpus"] * SPECS[s["gpu"]].peak_flops("bf16") * s["mfu"])  # seconds of one step's compute
    nvlink_first = all(node["nvlink4"] < node[k] for k in node_links[2:]) and node["nvlink4"] < min(
        network[k] for k in network_links)
    floor_hides = network["rdma100"] <= compute
    hiding = [links[k].name for k in network_links if network[k] <= compute]
    verdict = "holds" if nvlink_first and floor_hides else "holds with conditions" if nvlink_first else "wrong"
    ms = lambda t: f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"
    return Measurement(
        value={**{f"{k} ({s['node_gpus']} GPUs)": node[k] for k in node_links},
               **{f"{k} ({s['cluster_gpus']} GPUs)": network[k] for k in network_links},
               "compute per step (s)": compute},
        unit="s",
        text=(f"ring all-reduce of a {s['n_params'] / 1e9:g}B model's bf16 gradients "
              f"({s['n_params'] * s['bytes_per_param'] / 1e9:g} GB) per step, α-β model: in one {s['node_gpus']}-GPU "
              f"node " + ", ".join(f"{links[k].name} {ms(node[k])}" for k in node_links)
              + f"; across {s['cluster_gpus']} GPUs, one NIC each: "
              + ", ".join(f"{links[k].name} {ms(network[k])}" for k in network_links)
              + f". A {s['tokens'] / 2**20:g}M-token step computes in {ms(compute)} on {s['cluster_gpus']} "
              f"{s['gpu']} at {s['mfu']:.0%} MFU. NVLink 4 beats PCIe 4 by {node['pcie4'] / node['nvlink4']:.0f}× "
              f"and 100 Gb/s by {network['rdma100'] / node['nvlink4']:.0f}×; "
              + ("100 Gb/s hides behind the compute" if floor_hides else
                 f"100 Gb/s cannot hide behind the compute ({ms(network['rdma100'])} > {ms(compute)}); "
                 + (f"only {', '.join(hiding)} can" if hiding else "no network here can"))),
        device="computed", verdict=verdict)
