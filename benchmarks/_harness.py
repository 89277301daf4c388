"""The one benchmark harness every ``bench_<op>.py`` sits on.

- ``time_gpu(fn)``: warm-up (compile excluded), CUDA-event timing of each call with the L2
  flushed before it, median and spread over ``rep`` calls.
- ``copy_bandwidth()``: device-to-device copy GB/s (bytes read + written), measured in the same
  run as the op it is compared with.
- ``knob_settings(items)``: ``SCOPE.KNOB=VALUE`` strings as an ``overrides(**...)`` mapping.
- ``Results``: rows (GPU, versions, commit, op, shape, ours, baseline, ratio) appended to a CSV in
  ``benchmarks/results/`` (or ``$OUT`` on the device machine), then plotted by ``plot.py``.

Baselines (torch / CuPy) run in the same process, on the same data and stream.
"""

import csv
import datetime
import os
import statistics
import subprocess
import sys

import numpy as np

RESULTS_DIR = os.environ.get("LLMSPEED_RESULTS_DIR",
                             os.path.join(os.path.dirname(__file__), "results"))
FIELDS = ["date", "gpu", "commit", "op", "case", "shape", "dtype", "ours_ms", "ours_spread_ms",
          "baseline", "baseline_ms", "unit", "ours_value", "baseline_value", "ratio", "versions",
          "note"]


def commit():
    env = os.environ.get("LLMSPEED_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except Exception:
        return "unknown"


def versions():
    import numba
    from numba import cuda

    parts = [f"py{sys.version_info.major}.{sys.version_info.minor}", f"numba {numba.__version__}",
             f"numba-cuda {getattr(cuda, '__version__', '?')}", f"numpy {np.__version__}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    return "; ".join(parts)


def gpu_name():
    from numba import cuda

    name = getattr(cuda.get_current_device(), "name", "CUDA simulator")  # the simulator's has none
    return name.decode() if isinstance(name, bytes) else name


class _Flusher:
    """Reads a buffer larger than the L2 before each timed call. A read, not a write: writing
    it (as this did up to c111c38) left the L2 full of dirty lines, whose write-back (~50 MB)
    then landed inside the timed call, adding ~10 us to every flushed time - most visible on
    small calls (softmax 64 x 128256, decode at batch 1) for ours and the baselines alike. The
    read evicts every earlier line (writing back dirty ones before the timed region) and leaves
    clean lines that are dropped for free."""

    def __init__(self, nbytes=256 << 20):
        import torch

        self.buf = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
        self.sink = torch.empty((), dtype=torch.int64, device="cuda")

    def __call__(self):
        import torch

        torch.sum(self.buf, dim=0, dtype=torch.int64, out=self.sink)


_FLUSHER = None


#: GPU cycles the stream spins after the L2 flush, before the start event: the host launches
#: ``fn`` meanwhile, so its Python overhead (up to ~250 us) is not counted as GPU time. Without
#: it, a call whose host side outlasts the flush shows its host time, not its kernels'.
HOST_SLACK_CYCLES = 600_000


def knob_settings(items):
    """``{scope: {knob: value}}`` for ``_overrides.overrides`` from ``SCOPE.KNOB=VALUE`` strings
    (the value a Python literal); ``ValueError`` naming the string at fault."""
    import ast

    knobs: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        scope, dot, knob = name.partition(".")
        if not (sep and dot and scope and knob):
            raise ValueError(f"expected SCOPE.KNOB=VALUE, got {item!r}")
        try:
            knobs.setdefault(scope, {})[knob] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{item!r}: the value must be a Python literal") from None
    return knobs


def time_gpu(fn, warmup=3, rep=20, flush_l2=True, hide_host=True):
    """Median and spread (p20..p80) in ms of the GPU time of ``fn()`` on the current torch
    stream (with ``hide_host=False``: the time the caller waits, host overhead included)."""
    import torch

    global _FLUSHER
    if flush_l2 and _FLUSHER is None:
        _FLUSHER = _Flusher()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        if flush_l2:
            _FLUSHER()
        if hide_host:
            torch.cuda._sleep(HOST_SLACK_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median": statistics.median(times), "p20": q(0.2), "p80": q(0.8)}


def back_to_back_ms(fn, calls=200, rounds=5):
    """GPU ms a call of ``fn`` (e.g. a CUDA graph's ``replay``) issued ``calls`` times back to
    back, no flush or sleep between (a steady stream of steps), for each of ``rounds``."""
    import torch

    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def graphed(fn):
    """A CUDA graph replaying one call of ``fn`` (after warm-ups, so workspaces and library
    handles exist before capture), or None if ``fn`` cannot be captured (time it eagerly)."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        print(f"  (graph capture failed, timing eagerly: {type(exc).__name__}: {exc})")
        return None
    torch.cuda.synchronize()
    g._keep = fn  # the closure's tensors must outlive the graph
    return g.replay


def copy_bandwidth(nbytes=2 << 30, *, flush_l2=False, graph=False):
    """Device-to-device copy GB/s (read + write bytes) of a ``nbytes`` fp16 buffer.

    The default is the 2 GiB reference: L2 not flushed (the buffer dwarfs it), timed eagerly.
    For a copy of the same size as an op (``nbytes`` = half the op's bytes moved, so the copy
    moves as many), time it as the op is: ``flush_l2=True`` and ``graph=True`` (replayed from a
    CUDA graph). At tens of MB the launch, the ramp and the dirty lines the L2 flush leaves (each
    evicted line is written back during the timed call) weigh as much as the transfer."""
    import torch

    src = torch.empty(max(nbytes // 2, 1), dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)

    def fn():
        dst.copy_(src)

    replay = graphed(fn) if graph else None
    t = time_gpu(replay or fn, flush_l2=flush_l2)
    return 2 * 2 * src.numel() / (t["median"] * 1e-3) / 1e9


class Results:
    """Collects benchmark rows and appends each, as it is measured, to
    ``<results dir>/<name>.csv`` (so a run cut short keeps what it measured)."""

    def __init__(self, name, directory=None):
        self.name = name
        self.directory = directory or os.environ.get("OUT") or RESULTS_DIR
        self.rows = []
        self.gpu = gpu_name()
        self.commit = commit()
        self.versions = versions()
        self.date = datetime.date.today().isoformat()

    def add(self, op, case, shape, dtype, ours, baseline_name, baseline, unit, ours_value,
            baseline_value, note=""):
        ratio = ours_value / baseline_value if baseline_value else float("nan")
        if unit in ("ms", "us"):  # lower is better: ratio is baseline time / our time
            ratio = baseline_value / ours_value if ours_value else float("nan")
        row = {"date": self.date, "gpu": self.gpu, "commit": self.commit, "op": op,
               "case": case, "shape": shape, "dtype": dtype,
               "ours_ms": f"{ours['median']:.5f}",
               "ours_spread_ms": f"{ours['p20']:.5f}-{ours['p80']:.5f}",
               "baseline": baseline_name,
               "baseline_ms": f"{baseline['median']:.5f}" if baseline else "",
               "unit": unit, "ours_value": f"{ours_value:.4g}",
               "baseline_value": f"{baseline_value:.4g}" if baseline_value else "",
               "ratio": f"{ratio:.3f}", "versions": self.versions, "note": note}
        self.rows.append(row)
        self._append([row])
        print(f"{op:>22} {case:>28} {dtype:>9} ours {ours_value:10.4g} {unit:8} "
              f"{baseline_name:>14} {baseline_value or float('nan'):10.4g}  ratio {ratio:6.3f}",
              flush=True)
        return row

    @property
    def path(self):
        return os.path.join(self.directory, f"{self.name}.csv")

    def _append(self, rows):
        os.makedirs(self.directory, exist_ok=True)
        new = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerows(rows)

    def write(self, directory=None):
        """The CSV's path (rows are already appended as they are added)."""
        return self.path


def plot_csv(path):
    """PNG beside the CSV through ``benchmarks/plot.py`` (None, with a note, when matplotlib is
    missing: the CSV is the result)."""
    try:
        from plot import plot

        return plot(path)
    except Exception as exc:  # noqa: BLE001
        print(f"plot skipped: {type(exc).__name__}: {exc}")
        return None
