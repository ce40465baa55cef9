"""Watch a training run: metrics per step, TensorBoard event files, a live plot, a profiler split, GPU stats.

The material (§6.3 and its closing advice) asks to watch GPU utilisation (nvidia-smi), communication time
(PyTorch profiler) and memory (torch.cuda.memory_allocated(), here `runtime.memory_allocated()`), with TensorBoard
or WandB, while training runs. Practitioners add two figures that say more than utilisation does:

- **MFU**, model-FLOPs utilisation (Chowdhery et al. 2022, the PaLM paper, §4.1 and Appendix B): the tokens/s the
  run achieves × 6N FLOPs per token (N parameters, forward + backward) over the device's peak FLOP/s. The peak
  (`Peak`, from `device_peak`) is the spec sheet's figure for a GPU it has a row for (`llmlab.hardware.specs`, the
  column of the run's precision), else this device's measured fp32 matmul (`llmlab.hardware.matmul_peak`, the
  roofline's flat roof); `peak.source` says which, and is printed beside the figure. nvidia-smi's "GPU-Util" is
  another thing: the share of the sample period during which one or more kernels was executing (NVML's
  nvmlUtilization_t.gpu, https://docs.nvidia.com/deploy/nvml-api/structnvmlUtilization__t.html), however little
  of the chip each kernel used, so a GPU at 100% util can run at a low MFU. 6N leaves out PaLM's attention term
  (App. B: 12·L·H·Q·T more FLOPs per token, L layers, H heads of size Q, T tokens of context; nanoGPT's
  estimate_mfu adds it); N is `num_params()` where the model has one (nanoGPT's: position embeddings left out).
  A peak measured once (at `watch`) and a speed measured later can see different loads on a shared machine:
  `interleaved_mfu(fn, flops)` times the peak matmul and `fn` (one update) in the same interleaved rounds instead.
- **the update/weight ratio** ‖Δθ‖/‖θ‖ of each update, over all parameters ("update_ratio") and per parameter
  tensor (`update_ratios`): how far one update moved the weights, relative to their size. The cs231n notes
  (Karpathy, "Neural Networks Part 3", "Ratio of weights:updates", https://cs231n.github.io/neural-networks-3/#ratio)
  give "a rough heuristic ... somewhere around 1e-3": much higher, the learning rate is likely too high; much
  lower, too low.

Both need the model: the Trainer hands it over by calling `monitor.watch(model, precision=, devices=)` (a monitor
without `watch` gets neither). The ratio keeps a copy of the weights from the last logged update (one more copy of
the parameters' memory); with `log_interval` k > 1 it is the ratio over the last k updates.

    from llmlab.monitor import Monitor, profile_step, gpu_stats
    with Monitor(logdir="runs/ch06", live=True) as monitor:    # live: a plot in the notebook, updated in place
        for step in range(100):
            monitor.log(step, {"loss": loss, "lr": lr})        # the Trainer calls this every step
    monitor.history["loss"]                                    # [(step, value), ...]
    monitor.history["mfu"], monitor.peak.source                # under a Trainer: MFU per update, and its peak
    print(monitor.timed("step_time_s"))                        # every step's time: "41.2 ms ±9%" (timing.Timing)
    profile_step(step_fn)                                      # {"compute": s, "communication": s, "other": s, ...}
    gpu_stats()                                                # None on a CPU machine (the CPU's under smoke mode)

`import llmlab.monitor` loads neither TensorBoard nor IPython: they are imported when asked for.
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from llmlab import hardware, runtime, timing, validation

__all__ = ["PRECISIONS", "Monitor", "Peak", "device_peak", "interleaved_mfu", "profile_step", "gpu_stats",
           "memory_bytes", "COMM_PREFIXES"]

# units of the metrics the Trainer logs, for the panels' titles
_UNITS = {"loss": "nats/token", "tokens_per_s": "tokens/s", "step_time_s": "s", "comm_s": "s",
          "memory_bytes": "bytes", "update_ratio": "‖Δθ‖/‖θ‖, log scale"}
_LOG_SCALE = ("update_ratio",)
PRECISIONS = ("fp32", "bf16", "fp16")  # what a run trains in, for the peak it is measured against


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s, against which MFU is reckoned, and where the figure comes from."""

    flops: float  # FLOP/s of one device
    source: str  # e.g. "spec sheet: H100 SXM, bf16 dense (NVIDIA H100 Tensor Core GPU datasheet (2023); ...)"
    label: str  # a few words for a panel's title: "spec sheet H100 SXM bf16", "measured fp32 matmul"

    def __post_init__(self):
        validation.number("flops", self.flops, above=0, hint="(a device's peak FLOP/s: MFU divides by it)")
        if not math.isfinite(self.flops):
            raise ValueError(f"flops={self.flops!r} must be a finite number of FLOP/s")


def device_peak(device=None, precision: str = "fp32", seconds: float = 0.5) -> Peak:
    """The peak FLOP/s of `device` (default: this tier's) for a run in `precision` ("fp32", "bf16", "fp16").

    A GPU with a row on the spec sheet (`hardware.for_device`): its dense figure for the precision — BF16 on the
    tensor cores for bf16 and fp16 (the same rate on these parts), TF32 for fp32 where torch lets matmuls use it
    (`torch.get_float32_matmul_precision() != "highest"`), else the FP32 (SIMT) figure. Any other device, this CPU
    included: `hardware.matmul_peak(seconds=)`, the fp32 n×n matmul of the roofline's flat roof, on the threads
    torch uses now (about `seconds`).
    """
    validation.one_of("precision", precision, PRECISIONS)
    if math.isinf(validation.positive("seconds", seconds)):
        raise ValueError(f"seconds={seconds!r} must be a finite number of seconds")
    device = runtime.usable_device(device)
    if device.type == "meta":  # a meta tensor holds no data: a "measured" matmul on it takes no time
        raise ValueError(f"device={str(device)!r} has no peak to measure: meta tensors compute nothing; give the "
                         "device the run trains on")
    row = hardware.for_device(hardware.device_name(device)) if device.type == "cuda" else None
    if row is not None:
        column = "bf16" if precision in ("bf16", "fp16") else (
            "tf32" if torch.get_float32_matmul_precision() != "highest" and row.tf32_tflops else "fp32")
        return Peak(row.peak_flops(column), f"spec sheet: {row.name}, {column} dense ({row.source})",
                    f"spec sheet {row.name} {column}")
    flops, n, t = hardware.matmul_peak(device, seconds=seconds)
    threads = torch.get_num_threads()
    return Peak(flops, f"measured: fp32 {n}×{n} matmul on {hardware.device_name(device)}, {threads} "
                       f"thread{'s' * (threads != 1)}, ±{t.spread:.0%} (llmlab.hardware.matmul_peak)",
                f"measured fp32 matmul, {threads} thread{'s' * (threads != 1)}")


def interleaved_mfu(fn: Callable, flops: float, device=None, seconds: float = 1.0) -> tuple[Peak, hardware.Rate]:
    """`fn`'s MFU against this device's fp32 n×n matmul, both timed in the same interleaved rounds (chapter 1's
    method, `timing.interleave`): a busy machine slows both alike, so the ratio holds where a peak measured at
    another moment (`device_peak`, once at `watch`) would not. `fn` does `flops` model FLOPs per call (for a
    training update: 6N × its tokens). Returns (the matmul's Peak, from these rounds; the Rate: `.value` the MFU,
    `.spread` over the rounds); the matmul is `hardware.peak_matmul`'s."""
    if not callable(fn):
        raise ValueError(f"fn={fn!r} must be callable")
    validation.positive("flops", flops)
    if math.isinf(validation.positive("seconds", seconds)):
        raise ValueError(f"seconds={seconds!r} must be a finite number of seconds")
    device = runtime.usable_device(device)
    n, product = hardware.peak_matmul(device)  # the roof's n×n fp32 product, n the size that fills this device
    rounds = timing.interleave({"peak": product, "fn": fn}, device=device, budget_s=seconds)
    matmul, threads = rounds["peak"], torch.get_num_threads()
    peak = Peak(2 * n**3 / matmul.seconds,
                f"measured: fp32 {n}×{n} matmul on {hardware.device_name(device)}, {threads} thread"
                f"{'s' * (threads != 1)}, ±{matmul.spread:.0%} over {len(matmul.samples)} rounds interleaved with "
                "the run's own update (llmlab.monitor.interleaved_mfu)", "measured fp32 matmul, interleaved")
    return peak, hardware.Rate(rounds.ratio("peak", "fn"), flops / (2 * n**3))


# torch.profiler op names of collectives: the c10d dispatcher op, the backend's work item, the comms record
COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")


def memory_bytes() -> int:
    """Memory in use now: the CUDA allocator's peak since the last call on a GPU (reset after reading),
    else this process's resident set (psutil), which is what a CPU run has in place of device memory."""

    device = runtime.device()
    if device.type != "cuda":
        return runtime.memory_allocated(device)  # the resident set
    peak = runtime.max_memory_allocated(device)
    runtime.reset_peak_memory_stats(device)
    return peak


def gpu_stats() -> dict | None:
    """GPU 0's utilisation (%) and memory used/total (bytes), and their `source` ("NVML" or "nvidia-smi"), or None
    where there is no GPU/NVML. Under smoke mode (`llmlab.runtime`) the CPU's, standing in for the GPU (psutil)."""
    if runtime.tier().smoke:
        import psutil  # a dependency of llmlab (the grader's process handling)

        memory = psutil.virtual_memory()
        return {"utilization": psutil.cpu_percent(interval=0.1), "memory_used": int(memory.total - memory.available),
                "memory_total": int(memory.total), "source": "psutil: smoke mode's CPU"}
    try:
        import pynvml  # optional: NVIDIA's bindings, on GPU machines
    except ImportError:
        return _nvidia_smi()
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        util, mem = pynvml.nvmlDeviceGetUtilizationRates(handle), pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"utilization": float(util.gpu), "memory_used": int(mem.used), "memory_total": int(mem.total),
                "source": "NVML"}
    except pynvml.NVMLError:
        return None


def _nvidia_smi() -> dict | None:
    """The same numbers from `nvidia-smi`, when it is on PATH."""

    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,memory.total",
                          "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        return None
    util, used, total = (float(v) for v in out.stdout.strip().split(","))
    return {"utilization": util, "memory_used": int(used * 2**20), "memory_total": int(total * 2**20),
            "source": "nvidia-smi"}


def profile_step(fn: Callable, *args, **kwargs) -> dict:
    """Run `fn(*args, **kwargs)` once under torch.profiler; split its wall time into compute, communication
    and other (Python, waiting, everything no op accounts for). Seconds, plus "table" (a printable text).

    Ops are counted by their *self* time so nested ops (aten::matmul → aten::mm) count once. On a GPU the
    device's kernel times are used instead (NCCL kernels are communication), since CPU ops only launch them.
    """
    if not callable(fn):
        raise ValueError(f"fn={fn!r} must be callable")

    # Kineto prints "profiler_start"/"profiler_stop" lines at every profile unless told otherwise before its first
    # use in the process; on a Cluster of ranks that is two lines per rank per call (the user's setting wins)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    device = runtime.device()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn(*args, **kwargs)
        runtime.synchronize(device)
        wall = time.perf_counter() - start
    compute = communication = 0.0
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total  # microseconds
        if e.key.startswith(COMM_PREFIXES) or (cuda and "nccl" in e.key.lower()):
            communication += us / 1e6
        else:
            compute += us / 1e6
    other = max(wall - compute - communication, 0.0)  # ops can overlap (threads, streams): never negative
    rows = {"compute": compute, "communication": communication, "other": other}
    table = "\n".join([f"{'part':<15}{'seconds':>10}{'share':>8}"] +
                      [f"{k:<15}{v:>10.4f}{v / max(wall, 1e-12):>8.0%}" for k, v in rows.items()] +
                      [f"{'wall':<15}{wall:>10.4f}"])
    return {**rows, "wall": wall, "table": table}


def _metric(name, value) -> float:
    """A logged value as a float: a real number (int, float, NumPy scalar) or a one-element tensor; not a bool, a
    string or None, which float() would take or crash on. NaN and inf pass: a diverged run's loss is logged."""
    if not isinstance(name, str):
        raise ValueError(f"metric name {name!r} must be a str")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a real number (a bool or a string is not a metric)")
    return float(value)


class Monitor:
    """Keep every metric logged per step; optionally write TensorBoard events and draw a live plot.

    `logdir`: write TensorBoard event files there (needs `tensorboard`: `pip install llmlab[tensorboard]`).
    `live`: draw the metrics in the notebook, one panel each, redrawn in place at most every `every_s`
    seconds (drawing costs more than a tiny training step). `memory`: add "memory_bytes" to every step.
    `comm_log`: an open `llmlab.dist.CommLog`; each step logs the communication seconds since the last step.
    `peak`: what MFU divides by — "auto" (`device_peak` for the watched model's device and precision, found when
    `watch` is called), a `Peak`, or None (no MFU).

    Once `watch(model)` has been called (the Trainer does), every `log` adds "mfu" (when the metrics hold
    "tokens_per_s") and "update_ratio", and `update_ratios[name]` gets each parameter tensor's ratio.

    The live plot reads the clock only to pace its redraws; a duration summarised for a reader (the step time of a
    run) comes from `timed()`, which judges the steps' times as `llmlab.timing` judges any rounds.
    """

    def __init__(self, logdir: str | None = None, live: bool = False, every_s: float = 0.5, memory: bool = False,
                 comm_log=None, peak: Peak | str | None = "auto"):
        validation.number("every_s", every_s, low=0)
        if not (peak is None or peak == "auto" or isinstance(peak, Peak)):
            raise ValueError(f"peak={peak!r} must be 'auto', a monitor.Peak or None")
        self.peak = peak
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.update_ratios: dict[str, list[tuple[int, float]]] = {}  # per parameter tensor: [(step, ratio), ...]
        self.flops_per_token, self.devices, self._params, self._before = None, 1, {}, {}
        self.live, self.every_s, self.memory, self.comm_log = live, every_s, memory, comm_log
        self._comm_seen, self._last_draw, self._handle, self._fig = 0.0, -float("inf"), None, None
        self._load = timing.Load.now()  # the machine's load when the run started (`timed` takes the busier)
        self.writer = None
        if logdir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: pip install -e '.[tensorboard]'
            except ImportError as e:
                raise ImportError("Monitor(logdir=...) writes TensorBoard events and needs the tensorboard package:"
                                  " pip install 'llmlab[tensorboard]' (or pip install tensorboard)") from e
            self.writer = SummaryWriter(log_dir=str(logdir))

    def watch(self, model: torch.nn.Module, precision: str = "fp32", devices: int = 1) -> None:
        """Follow `model` from now on: its N for MFU (`model.num_params()` where it has one — nanoGPT's count, the
        tied embedding in, positions out — else every trainable parameter once), the devices the logged tokens/s
        is over, the peak (when "auto": `device_peak` of its parameters' device in `precision`) and a copy of its
        weights, against which the next `log` measures the update. Called again (after loading a saved state),
        it takes a fresh copy."""
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={model!r} must be a torch.nn.Module")
        validation.positive_int("devices", devices)
        validation.one_of("precision", precision, PRECISIONS)
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self._params:
            raise ValueError("model has no trainable parameter to watch")
        n = model.num_params() if callable(getattr(model, "num_params", None)) else sum(
            p.numel() for p in self._params.values())
        self.flops_per_token, self.devices = 6.0 * n, devices  # forward 2N + backward 4N per token
        if self.peak == "auto":
            self.peak = device_peak(next(iter(self._params.values())).device, precision)
        self._snapshot()

    def _snapshot(self) -> None:
        with torch.no_grad():
            self._before = {n: p.detach().clone() for n, p in self._params.items()}

    def _update_ratios(self, step: int) -> float:
        """‖θ − θ_before‖ / ‖θ_before‖ over all watched parameters (returned) and per tensor (appended to
        `update_ratios`; NaN for a tensor that was all zeros, e.g. a bias at initialisation); then a new copy."""
        moved = size = 0.0
        with torch.no_grad():
            for name, p in self._params.items():
                before, dtype = self._before[name], torch.promote_types(p.dtype, torch.float32)  # bf16 sums in fp32
                d2 = torch.linalg.vector_norm(p.detach() - before, dtype=dtype).item() ** 2
                w2 = torch.linalg.vector_norm(before, dtype=dtype).item() ** 2
                moved, size = moved + d2, size + w2
                self.update_ratios.setdefault(name, []).append((step, (d2 / w2) ** 0.5 if w2 > 0 else math.nan))
        self._snapshot()
        return (moved / size) ** 0.5 if size > 0 else math.nan

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` (name → number) at `step`; write and draw them as configured."""
        validation.integer("step", step, low=0)
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics must be a dict of name → number, got {type(metrics).__name__}")
        metrics = {k: _metric(k, v) for k, v in metrics.items()}
        if "tokens_per_s" in metrics and not (math.isfinite(metrics["tokens_per_s"]) and metrics["tokens_per_s"] >= 0):
            raise ValueError(f"tokens_per_s={metrics['tokens_per_s']!r} must be a finite number >= 0 (tokens per "
                             "second: MFU is computed from it)")
        if self._params:
            if isinstance(self.peak, Peak) and "tokens_per_s" in metrics:
                metrics["mfu"] = metrics["tokens_per_s"] * self.flops_per_token / (self.devices * self.peak.flops)
            metrics["update_ratio"] = self._update_ratios(step)
        if self.memory:
            metrics["memory_bytes"] = float(memory_bytes())
        if self.comm_log is not None:
            total = sum(s.seconds for s in self.comm_log.by_op().values())
            metrics["comm_s"], self._comm_seen = total - self._comm_seen, total
        for name, value in metrics.items():
            self.history.setdefault(name, []).append((step, value))
            if self.writer is not None:
                self.writer.add_scalar(name, value, step)
        if self.live and time.perf_counter() - self._last_draw >= self.every_s:
            self.draw()

    def timed(self, name: str = "step_time_s") -> timing.Timing:
        """The durations logged as `name` (seconds, one per logged step) as a `timing.Timing`: their median, their
        spread and the machine's load (the busier of the readings when the monitor started and now), so a step
        time prints as "41.2 ms ±9%" with its `note()` beside it."""
        durations = [v for _, v in self.history.get(name, [])]
        if not durations:
            raise ValueError(f"name={name!r}: no such durations logged (logged: {', '.join(self.history) or 'none'})")
        return timing.Timing.from_samples(durations, load=self._load.busier(timing.Load.now()))

    def figure(self):
        """A matplotlib Figure of the history, one panel per metric (not attached to pyplot)."""
        from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

        names = list(self.history) or ["(no metrics yet)"]
        fig = Figure(figsize=(3.2 * min(len(names), 4), 2.4 * ((len(names) + 3) // 4)), layout="constrained")
        for i, name in enumerate(names):
            ax = fig.add_subplot((len(names) + 3) // 4, min(len(names), 4), i + 1)
            points = self.history.get(name, [])
            ax.plot([s for s, _ in points], [v for _, v in points])
            if name in _LOG_SCALE and any(v > 0 for _, v in points):
                ax.set_yscale("log")
            unit = f"of {self.peak.label}" if name == "mfu" and isinstance(self.peak, Peak) else _UNITS.get(name)
            ax.set_title(f"{name} ({unit})" if unit else name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
        return fig

    def draw(self) -> None:
        """Show the plot in the notebook, replacing the previous one (a no-op outside IPython)."""
        try:
            from IPython import get_ipython  # may be absent: a training script runs without Jupyter
            from IPython.display import display  # (the same)
        except ImportError:
            return
        if get_ipython() is None:
            return
        fig = self.figure()
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)
        self._last_draw = time.perf_counter()  # after drawing: a draw slower than every_s must not run every step

    def close(self) -> None:
        """Flush and close the event files; draw the final plot when live."""
        if self.live:
            self.draw()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
