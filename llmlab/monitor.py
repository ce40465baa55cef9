"""Watch a training run: metrics per step, TensorBoard event files, a live plot, a profiler split, GPU stats.

The material (§6.3 and its closing advice) asks to watch GPU utilisation (nvidia-smi), communication time
(PyTorch profiler) and memory (torch.cuda.memory_allocated(), here `runtime.memory_allocated()`), with TensorBoard
or WandB, while training runs.

    from llmlab.monitor import Monitor, profile_step, gpu_stats
    with Monitor(logdir="runs/ch06", live=True) as monitor:    # live: a plot in the notebook, updated in place
        for step in range(100):
            monitor.log(step, {"loss": loss, "lr": lr})        # the Trainer calls this every step
    monitor.history["loss"]                                    # [(step, value), ...]
    print(monitor.timed("step_time_s"))                        # every step's time: "41.2 ms ±9%" (timing.Timing)
    profile_step(step_fn)                                      # {"compute": s, "communication": s, "other": s, ...}
    gpu_stats()                                                # None on a CPU machine (the CPU's under smoke mode)

`import llmlab.monitor` loads neither TensorBoard nor IPython: they are imported when asked for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

from llmlab import runtime, timing, validation

__all__ = ["Monitor", "profile_step", "gpu_stats", "memory_bytes", "COMM_PREFIXES"]

# units of the metrics the Trainer logs, for the panels' titles
_UNITS = {"loss": "nats/token", "tokens_per_s": "tokens/s", "step_time_s": "s", "comm_s": "s",
          "memory_bytes": "bytes"}

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


class Monitor:
    """Keep every metric logged per step; optionally write TensorBoard events and draw a live plot.

    `logdir`: write TensorBoard event files there (needs `tensorboard`: `pip install llmlab[tensorboard]`).
    `live`: draw the metrics in the notebook, one panel each, redrawn in place at most every `every_s`
    seconds (drawing costs more than a tiny training step). `memory`: add "memory_bytes" to every step.
    `comm_log`: an open `llmlab.dist.CommLog`; each step logs the communication seconds since the last step.

    The live plot reads the clock only to pace its redraws; a duration summarised for a reader (the step time of a
    run) comes from `timed()`, which judges the steps' times as `llmlab.timing` judges any rounds.
    """

    def __init__(self, logdir: str | None = None, live: bool = False, every_s: float = 0.5, memory: bool = False,
                 comm_log=None):
        validation.number("every_s", every_s, low=0)
        self.history: dict[str, list[tuple[int, float]]] = {}
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

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` (name → number) at `step`; write and draw them as configured."""
        validation.integer("step", step, low=0)
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics must be a dict of name → number, got {type(metrics).__name__}")
        metrics = {k: float(v) for k, v in metrics.items()}
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
            ax.set_title(f"{name} ({_UNITS[name]})" if name in _UNITS else name, fontsize=9)
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
