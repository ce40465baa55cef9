"""Chapter 5's claims (§5, hardware), computed: the material's GPU table against the spec sheet (C14), and its
network advice priced by the α-β model (C15)."""

from __future__ import annotations

from llmlab import flops
from llmlab.claims import Measurement, register
from llmlab.dist import cost
from llmlab.hardware import SPECS, cluster, material

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
    nbytes, n, per_node = s["n_params"] * s["bytes_per_param"], s["cluster_gpus"], s["node_gpus"]
    node = cost.gradient_allreduce_times(s["n_params"], per_node, s["bytes_per_param"])
    # across nodes, under each network of cluster.NETWORKS; inside a node NVLink 4 (the H100s' own link)
    network = {net: {k: cluster.allreduce_time(nbytes, n, per_node, net, k, "nvlink4") for k in network_links}
               for net in cluster.NETWORKS}
    compute = flops.training_flops(s["n_params"], s["tokens"]) / (
        s["cluster_gpus"] * SPECS[s["gpu"]].peak_flops("bf16") * s["mfu"])  # seconds of one step's compute
    nvlink_first = all(node["nvlink4"] < node[k] for k in node_links[2:]) and node["nvlink4"] < min(
        t for times in network.values() for t in times.values())
    floor_hides = {net: times["rdma100"] <= compute for net, times in network.items()}
    ms = lambda t: f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"

    def floor(net: str) -> str:
        t, hiding = network[net]["rdma100"], [links[k].name for k in network_links if network[net][k] <= compute]
        return (f"with {cluster.NETWORKS[net]} 100 Gb/s " + (f"hides behind the compute ({ms(t)} ≤ {ms(compute)})"
                                                              if floor_hides[net] else
                                                              f"cannot ({ms(t)} > {ms(compute)}; "
                                                              + (f"only {', '.join(hiding)} can)" if hiding else
                                                                 "no network here can)")))

    verdict = ("holds" if nvlink_first and all(floor_hides.values()) else "holds with conditions" if nvlink_first
               else "wrong")
    return Measurement(
        value={**{f"{k} ({per_node} GPUs)": node[k] for k in node_links},
               **{f"{k} ({n} GPUs, {net})": network[net][k] for net in network for k in network_links},
               "compute per step (s)": compute},
        unit="s",
        text=(f"all-reduce of a {s['n_params'] / 1e9:g}B model's bf16 gradients ({nbytes / 1e9:g} GB) per step, "
              f"α-β model: ring in one {per_node}-GPU node " + ", ".join(f"{links[k].name} {ms(node[k])}"
                                                                        for k in node_links)
              + "".join(f"; across {n // per_node} nodes of {per_node}, {cluster.NETWORKS[net]}: "
                          + ", ".join(f"{links[k].name} {ms(network[net][k])}" for k in network_links)
                          for net in network)
              + f". A {s['tokens'] / 2**20:g}M-token step computes in {ms(compute)} on {n} {s['gpu']} at "
              f"{s['mfu']:.0%} MFU. NVLink 4 beats PCIe 4 by {node['pcie4'] / node['nvlink4']:.0f}× and a flat ring "
              f"over 100 Gb/s by {network['nic-per-node']['rdma100'] / node['nvlink4']:.0f}×; "
              + "; ".join(floor(net) for net in network)
              + (". The advice's 100 Gb/s suffices for this step per GPU (a NIC each, one NCCL ring per NIC), not "
                 "per node" if floor_hides["nic-per-gpu"] and not floor_hides["nic-per-node"] else "")),
        device="computed", verdict=verdict)
