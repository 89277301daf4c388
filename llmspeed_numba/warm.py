"""Compile the kernels a model (or some of its ops) will need, ahead, in parallel processes.

numba compiles a kernel at its first launch (NVVM and ptxas: seconds each, one at a time in a
process) and keeps it in its disk cache. ``warm`` lists the kernels a workload needs by running
it with ``_launch.collecting_kernels`` (the op calls plan and validate as usual; no kernel is
compiled or launched), then compiles them in worker processes, each kernel rebuilt from the
factory that made it (``Kernel.origin``), into the disk cache, where every later process of the
same version on the same GPU model finds them.

The model workload: one prompt of each of ``prefill_lengths`` tokens (GEMM tiles are chosen by M)
and a decode step at each of ``decode_batches`` sequences, greedy, eager.
"""

import os
import pickle
import queue
import subprocess
import sys
import threading
import time

#: Prompt lengths of the model workload: each GEMM tile class of prefill (M up to 2048).
PREFILL_LENGTHS = (16, 128, 512, 2048)
#: Decode batch sizes of the model workload (``generate`` decodes one sequence).
DECODE_BATCHES = (1,)


def model_kernels(model=None, *, dtype="bfloat16", quantization=None,
                  prefill_lengths=PREFILL_LENGTHS, decode_batches=DECODE_BATCHES, loaded=None):
    """The distinct kernels (``Kernel`` objects) the model's prefill and decode launch. Loads the
    model (``quantization`` as ``load_model``'s) unless ``loaded`` (a ``models.Model``) is
    given."""
    from .models.model import load_model

    m = loaded if loaded is not None else load_model(model, dtype=dtype,
                                                     quantization=quantization)
    limit = m.config.max_position_embeddings - 2

    def workload():
        for n in prefill_lengths:
            m.generate_greedy([[1] * max(1, min(n, limit))], 2, stop_at_eos=False,
                              cuda_graphs=False)
        for b in decode_batches:
            m.generate_greedy([[1] * 8] * b, 2, stop_at_eos=False, cuda_graphs=False)

    return kernels_of(workload)


def kernels_of(workload):
    """The distinct kernels (``Kernel`` objects) ``workload()`` launches, none compiled or run
    (its op calls' outputs are left unwritten)."""
    from . import _replay
    from ._launch import collecting_kernels

    enabled = _replay.ENABLED
    _replay.ENABLED = False  # a recorded plan prepares its launches: that compiles
    try:
        with collecting_kernels() as found:
            workload()
    finally:
        _replay.ENABLED = enabled
    unique = {}
    for k in found:
        unique.setdefault(id(k), k)
    return list(unique.values())


def unresolved(kernels):
    """Those of ``kernels`` neither resolved in this process nor in the machine-code store:
    the ones a first launch could have to compile."""
    return [k for k in kernels if not k.resolvable()]


def op_of(kernel):
    """The op module a kernel belongs to ("gemm", "rms_norm", "flash_attn", ...)."""
    if kernel.origin is not None:
        module = kernel.origin[0]
    else:
        fn = getattr(kernel.dispatcher, "py_func", None) or getattr(kernel.dispatcher, "fn", None)
        module = getattr(fn, "__module__", "") or ""
    name = module.rsplit(".", 1)[-1].lstrip("_")
    for prefix in ("gemm", "flash_attn", "softmax", "paged_decode", "sample"):
        if name.startswith(prefix):
            return prefix
    return name


def compile_kernels(kernels, *, workers=None, on_start=None, on_done=None):
    """Compile ``kernels`` into numba's disk cache: those rebuildable from their factory in
    ``workers`` processes (default: the CPU count, at most one a kernel), the rest here.
    ``on_start(name)`` / ``on_done(name, ok, detail)`` report progress. Returns the number that
    compiled."""
    jobs, here = [], []
    for k in kernels:
        try:
            if k.origin is None:
                raise pickle.PicklingError("no factory")
            jobs.append((k.name, pickle.dumps(k.origin)))
        except (pickle.PicklingError, TypeError, AttributeError):
            here.append(k)
    ok = 0
    if jobs:
        ok += _compile_in_workers(jobs, workers or os.cpu_count() or 1, on_start, on_done)
    for k in here:
        if on_start:
            on_start(k.name)
        try:
            k.compiled()
            ok += 1
            if on_done:
                on_done(k.name, True, "")
        except Exception as exc:  # noqa: BLE001  (reported; the op compiles it at first use)
            if on_done:
                on_done(k.name, False, f"{type(exc).__name__}: {exc}")
    return ok


def _compile_in_workers(jobs, workers, on_start, on_done):
    workers = max(1, min(workers, len(jobs)))
    shares = [jobs[i::workers] for i in range(workers)]
    events: queue.Queue = queue.Queue()
    procs = []
    for share in shares:
        proc = subprocess.Popen([sys.executable, "-c", "from llmspeed_numba.warm import _worker; "
                                 "_worker()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=os.environ.copy())
        proc.stdin.write(pickle.dumps([origin for _, origin in share]))
        proc.stdin.close()
        names = [name for name, _ in share]
        threading.Thread(target=_relay, args=(proc, names, events), daemon=True).start()
        procs.append(proc)
    ok, finished = 0, 0
    while finished < len(procs):
        kind, name, detail = events.get()
        if kind == "start":
            if on_start:
                on_start(name)
        elif kind == "done":
            ok += detail == ""
            if on_done:
                on_done(name, detail == "", detail)
        else:  # a worker ended
            finished += 1
    for proc in procs:
        proc.wait()
    return ok


def _relay(proc, names, events):
    """Turn one worker's output lines into events; a worker that dies reports its kernels."""
    reported = set()
    for line in proc.stdout:
        kind, index, *rest = line.decode().rstrip("\n").split(" ", 2)
        i = int(index)
        if kind == "start":
            events.put(("start", names[i], None))
        else:
            reported.add(i)
            events.put(("done", names[i], "" if kind == "ok" else " ".join(rest)))
    proc.stdout.close()
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    proc.stderr.close()
    proc.wait()
    for i, name in enumerate(names):
        if i not in reported:
            events.put(("done", name, f"worker exited {proc.returncode}: "
                                      f"{err[-1] if err else 'no output'}"))
    events.put(("end", None, None))


def _lock_cache_index_writes():
    """numba rewrites a Python function's cache index (one file for all its specialisations)
    by reading, updating and writing it back, and names data files by the first free number:
    workers compiling two specialisations of one function at once would lose one. Serialise
    each save across processes with a lock file beside the index."""
    import fcntl

    from numba.cuda.core import caching

    save = caching.IndexDataCacheFile.save

    def locked_save(self, key, data):
        with open(self._index_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return save(self, key, data)

    caching.IndexDataCacheFile.save = locked_save


def _worker():
    """A compile worker: pickled origins on stdin; "start i", then "ok i" or "fail i why" a
    kernel on stdout."""
    import importlib

    origins = pickle.loads(sys.stdin.buffer.read())
    _lock_cache_index_writes()
    out = sys.stdout
    for i, blob in enumerate(origins):
        out.write(f"start {i}\n")
        out.flush()
        try:
            module, name, args = pickle.loads(blob)
            kernel = getattr(importlib.import_module(module), name)(*args)
            kernel.compiled()
            out.write(f"ok {i}\n")
        except Exception as exc:  # noqa: BLE001  (reported to the parent)
            why = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            out.write(f"fail {i} {why}\n")
        out.flush()


def warm(model=None, *, dtype="bfloat16", ops=None, workers=None, on_start=None, on_done=None,
         loaded=None, prefill_lengths=PREFILL_LENGTHS, decode_batches=DECODE_BATCHES):
    """List the model's kernels (only those of ``ops`` if given) and compile them. Returns
    ``(kernels, compiled, seconds)``."""
    start = time.perf_counter()
    kernels = model_kernels(model, dtype=dtype, loaded=loaded, prefill_lengths=prefill_lengths,
                            decode_batches=decode_batches)
    if ops:
        kernels = [k for k in kernels if op_of(k) in ops]
    compiled = compile_kernels(kernels, workers=workers, on_start=on_start, on_done=on_done)
    return len(kernels), compiled, time.perf_counter() - start


def run_with_progress(model=None, *, dtype="bfloat16", quantization=None, ops=None,
                      workers=None, loaded=None, log=sys.stderr):
    """``warm`` with a progress bar on ``log`` and a summary line; returns the kernels that
    failed to compile (they compile at first use instead), and marks the model warm."""
    t0 = time.perf_counter()
    kernels = model_kernels(model, dtype=dtype, quantization=quantization, loaded=loaded)
    if ops:
        unknown = set(ops) - {op_of(k) for k in kernels}
        if unknown:
            print(f"warm: no kernel of {sorted(unknown)} in this model's forward pass", file=log)
        kernels = [k for k in kernels if op_of(k) in ops]
    failed = compile_with_progress(kernels, workers=workers, log=log, what="warm")
    print(f"warm: {len(kernels) - len(failed)} of {len(kernels)} kernels ready in "
          f"{time.perf_counter() - t0:.1f} s", file=log, flush=True)
    if not failed and not ops:
        _mark_warm(model, dtype, quantization)
    return failed


def compile_with_progress(kernels, *, workers=None, log=sys.stderr, what="warm"):
    """``compile_kernels`` with a progress bar on ``log``, its lines prefixed ``what``; returns
    the kernels that failed to compile ("name: why"; they compile at first use instead)."""
    from ._progress import ProgressBar

    bar = None
    failed = []

    def start(name):
        nonlocal bar
        if bar is None:
            bar = ProgressBar(len(kernels), log)
        bar.start(name)

    def done(name, ok, detail):
        if not ok:
            failed.append(f"{name}: {detail}")
        bar.done(name, ok)

    print(f"{what}: compiling {len(kernels)} kernels in up to {workers or os.cpu_count()} "
          f"processes", file=log, flush=True)
    compile_kernels(kernels, workers=workers, on_start=start, on_done=done)
    if bar is not None:
        bar.close()
    for line in failed:
        print(f"{what}: failed {line}", file=log)
    return failed


def _marker(model, dtype, quantization=None):
    """The file saying this model's kernels were compiled (``marker_path`` of the model, dtype
    and quantization: other kernels)."""
    where = "default" if model is None else os.path.abspath(os.fspath(model))
    return marker_path(where, dtype, quantization)


def marker_path(*parts):
    """A marker file under the cache, keyed by ``parts`` (str-able) and everything a kernel
    binary depends on besides: the library's version and source, numba-cuda and PTX-backend
    versions, the GPU."""
    import hashlib

    import numba

    from . import __version__, _kernel_cache, _tuning_cache, ptx

    key = "|".join(str(p) for p in (*parts, __version__, _kernel_cache.package_digest(),
                                     numba.__version__, _cuda_version(), ptx.BACKEND,
                                     _tuning_cache.device_name()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(_tuning_cache.cache_dir(), "warm", f"{digest}.done")


def _cuda_version():
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:  # noqa: BLE001
        return "?"


def _mark_warm(model, dtype, quantization=None):
    path = _marker(model, dtype, quantization)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{model or 'default'} {dtype} {quantization or ''}\n")


def is_warm(model, dtype, quantization=None):
    """True when ``warm`` completed for this model, dtype, quantization, version and GPU (see
    ``_marker``)."""
    return os.path.exists(_marker(model, dtype, quantization))
