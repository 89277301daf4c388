"""The autotune cache: the winning configuration of an op per GPU and shape class, on disk, and
the timer the tuners use. Depends on nothing but the environment: ``ops.gemm`` looks its winners
up and records what its ``tune`` finds (``llmspeed_numba.autotune`` is the public entry).

The cache is one JSON file, ``autotune.json`` in ``$LLMSPEED_NUMBA_CACHE`` (default
``~/.cache/llmspeed_numba``), keyed by GPU name, op and shape class (for gemm
``ops.gemm.shape_class``: dtypes, layout, and M, N, K rounded up to powers of two). Each entry
keeps the winner's fields and every candidate's median time.
"""

import json
import os
import statistics
import tempfile
import threading
import time

from . import _recording
from ._env import SIMULATOR, cuda

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
    _recording.clear()  # recorded calls launched the old winner


def forget():
    """Drop the in-memory copy (the next lookup rereads the file)."""
    with _lock:
        _memory.clear()
        _generation[0] += 1
    _recording.clear()


def time_ms(fn, stream=0, warmup=2, rep=10):
    """Median milliseconds of ``fn()`` on ``stream`` (CUDA events; wall clock in the simulator)."""
    _recording.not_replayable("autotuning")
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
