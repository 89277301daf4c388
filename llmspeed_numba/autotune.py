"""Autotuning: time the candidate tile configurations of an op once per shape class, and remember
the winner on disk.

    cfg = llmspeed_numba.autotune.autotune(a, b)        # times gemm's candidates for this shape
    llmspeed_numba.gemm(a, b)                           # now runs the winner for this shape class

``gemm(..., backend="auto")`` consults the cache on every call (a dict lookup); with
``LLMSPEED_NUMBA_AUTOTUNE=1`` in the environment a cache miss is tuned on the spot instead of
falling back to the heuristic.

The cache is one JSON file, ``autotune.json`` in ``$LLMSPEED_NUMBA_CACHE`` (default
``~/.cache/llmspeed_numba``), keyed by GPU name, op and shape class (``ops.gemm.shape_class``:
dtypes, layout, and M, N, K rounded up to powers of two). Each entry keeps the winner's fields and
every candidate's median time.
"""

import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Sequence

from ._env import SIMULATOR, cuda
from ._typing import ArrayLike, DTypeLike, StreamLike

if TYPE_CHECKING:  # ops.gemm imports this module
    from .ops.gemm_configs import GemmConfig

_lock = threading.Lock()
_memory = {}   # path -> parsed cache file


def enabled():
    """True when ``LLMSPEED_NUMBA_AUTOTUNE`` asks for tuning on cache misses."""
    return os.environ.get("LLMSPEED_NUMBA_AUTOTUNE", "0") not in ("", "0")


def cache_dir():
    return os.environ.get("LLMSPEED_NUMBA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmspeed_numba")


def cache_path():
    return os.path.join(cache_dir(), "autotune.json")


_device = []


def device_name():
    if SIMULATOR:
        return "simulator"
    if not _device:
        name = cuda.get_current_device().name
        _device.append(name.decode() if isinstance(name, bytes) else str(name))
    return _device[0]


def _load(path):
    data = _memory.get(path)
    if data is None:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):  # absent or unreadable: start empty
            data = {}
        _memory[path] = data
    return data


_generation = [0]


def generation():
    """A number that changes whenever a winner is recorded or the cache is forgotten (callers
    memoising lookups key on it, with the cache directory)."""
    return _generation[0]


def lookup(op, key):
    """The cached winner (a dict of config fields) for ``op`` / ``key`` on this GPU, or None."""
    path = cache_path()
    with _lock:
        entry = _load(path).get(device_name(), {}).get(op, {}).get(key)
    return None if entry is None else dict(entry["config"])


def record(op, key, config, timings):
    """Store ``config`` (a dict) as the winner, with every candidate's time, and save."""
    path = cache_path()
    with _lock:
        data = _load(path)
        data.setdefault(device_name(), {}).setdefault(op, {})[key] = {
            "config": dict(config), "ms": timings}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent readers see the old or the new file
        _generation[0] += 1


def forget():
    """Drop the in-memory copy (the next lookup rereads the file)."""
    with _lock:
        _memory.clear()
        _generation[0] += 1


def time_ms(fn, stream=0, warmup=2, rep=10):
    """Median milliseconds of ``fn()`` on ``stream`` (CUDA events; wall clock in the simulator)."""
    for _ in range(warmup):
        fn()
    times = []
    if SIMULATOR:
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    s = cuda.external_stream(stream) if stream else cuda.default_stream()
    for _ in range(rep):
        start, end = cuda.event(), cuda.event()
        start.record(s)
        fn()
        end.record(s)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def tune_gemm_problem(p, candidates=None, warmup=2, rep=10):
    """Time gemm's candidates for a validated problem (``ops.gemm._Problem``); record and return
    the fastest ``GemmConfig``. Runs into a scratch output, so ``out`` / ``c`` are untouched."""
    from ._arrays import empty
    from ._checks import tensor
    from .ops import gemm as g
    from .ops import gemm_configs

    scratch = empty(p.ta, (p.M, p.N), p.out_dtype)
    trial = dataclasses.replace(p, to=tensor(scratch, "scratch"), out=scratch)
    timings = {}
    best, best_ms = None, float("inf")
    for cfg in candidates or gemm_configs.candidates(p):
        try:
            cfg.check()
            ms = time_ms(lambda cfg=cfg: g._run(trial, cfg), p.stream, warmup, rep)
        except (ValueError, RuntimeError) as exc:  # does not fit / fails to launch here
            timings[cfg.name] = f"skipped: {exc}"
            continue
        timings[cfg.name] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"autotune: no candidate ran for {p.key}: {timings}")
    record("gemm", p.key, dataclasses.asdict(best), timings)
    return best


def autotune(a: ArrayLike, b: ArrayLike, *, c: ArrayLike | None = None, alpha: float = 1.0,
             beta: float = 0.0, bias: ArrayLike | None = None, activation: str | None = None,
             out: ArrayLike | None = None, out_dtype: DTypeLike | None = None,
             backend: str = "auto", stream: StreamLike = None,
             candidates: "Sequence[GemmConfig | str | dict] | None" = None, warmup: int = 2,
             rep: int = 10) -> "GemmConfig":
    """Autotune ``gemm`` for the shape class of these arguments (same meaning as ``gemm``'s);
    returns the winning ``GemmConfig``, which later ``gemm`` calls of the class then use.
    ``candidates``: the configurations to time (default: ``ops.gemm_configs.candidates``)."""
    from .ops import gemm as g
    from .ops import gemm_configs

    p = g._prepare(a, b, c, alpha, beta, bias, activation, out, out_dtype, backend, stream)
    if min(p.M, p.N, p.K) == 0:
        raise ValueError(f"autotune: nothing to tune for an empty problem "
                         f"(M, N, K) = {(p.M, p.N, p.K)}")
    if candidates is not None:
        candidates = [gemm_configs.resolve_config(x) for x in candidates]
    return tune_gemm_problem(p, candidates, warmup, rep)


__all__ = ["autotune", "lookup", "record", "enabled", "cache_dir", "cache_path", "time_ms",
           "forget", "generation"]
