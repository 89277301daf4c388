"""GEMM on the GPU, side by side with cuBLAS through ``torch.matmul`` (and CuPy where installed),
same process, same data, same stream.

    python benchmarks/bench_gemm.py [--quick] [--sweep | --only-sweep] [--eager] [--autotune]
                                    [--no-linked] [--workers N]

- Tensor Core fp16 / bf16: squares 1024, 2048, 4096, 8192 and LLM shapes M in {1, 16, 128, 2048,
  8192} x (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}; row-major a (M, K) and b (K, N);
  CuPy beside torch for fp16.
- SIMT fp32 against torch fp32 with TF32 off (squares 1024, 2048, 4096).
- The ``@intrinsic`` PTX backend against the linked backend on 4096^3 fp16: a child process
  with ``LLMSPEED_NUMBA_PTX_BACKEND=linked`` (the switch is read at import; linked kernels are
  not disk-cached), started first so that it compiles while the rest does; it times only while
  this process waits. Skipped when that backend fails.
- ``--quick``: the four target squares (4096 and 8192, fp16 and bf16), SIMT fp32 4096, and three
  LLM shapes (decode M = 1, split-K M = 128, prefill M = 2048 with K = 14336) in both dtypes.
- ``--sweep``: afterwards, the candidates for ``gemm.LARGE_CONFIG`` (``SWEEP_TC``) on 4096^3 and
  8192^3 in fp16 and bf16, and ``SWEEP_SIMT`` on fp32 4096^3; without ``--quick`` also the
  autotuner's candidates on three LLM shapes. ``--only-sweep``: the sweep alone (the run that
  picks ``LARGE_CONFIG`` / ``SIMT_CONFIG``).
- ``--autotune``: autotune each shape first (slow: compiles every candidate), so the rows show
  the tuned winners; the winners stay in the autotune cache (``$LLMSPEED_NUMBA_CACHE``).

Compiles: every distinct kernel (configuration x dtype x split-K or not) takes ~15 s to compile,
and a full run needs ~25 of them. Before timing anything, ``--workers`` child processes (default:
the CPU count - 2) run each planned case once, which compiles its kernels into numba's disk cache
in parallel; this process then loads them from the cache. (numba's cache index is not safe for
concurrent writers, so the children serialise their cache writes with a file lock.)

TFLOP/s = 2 * M * N * K / time. Each call is captured once in a CUDA graph and the graph replay
is timed (``time_gpu``: L2 flushed before each call, median of 20): the kernels' time without
Python launch overhead, for ours and the baselines alike (``--eager`` times plain calls, which
for decode shapes mostly measures the host). Rows are appended to ``gemm.csv`` in ``$OUT`` or
``benchmarks/results/`` as they are measured, with a PNG beside it at the end, and the headline
ratios to ``gemm_headline.md``.
"""

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, graphed, plot_csv, time_gpu

from llmspeed_numba.ops import gemm_configs as gemm_mod
from llmspeed_numba.ops.gemm import gemm
from llmspeed_numba.ops.gemm_configs import LARGE_CANDIDATES, SMALL_M_CANDIDATES

# the module (the package may export the function ``autotune`` under the same name)
autotune_mod = importlib.import_module("llmspeed_numba.autotune")

DTYPES = ("float16", "bfloat16")
SQUARES = [1024, 2048, 4096, 8192]
TARGET_SQUARES = [4096, 8192]
LLM_M = [1, 16, 128, 2048, 8192]
LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336)]
QUICK_LLM = [(1, 4096, 4096), (128, 14336, 4096), (2048, 4096, 14336)]
SIMT_SQUARES = [1024, 2048, 4096]
LINKED_SHAPES = [(4096, 4096, 4096)]
#: Candidates for ``gemm.LARGE_CONFIG``: the three large tiles, a deeper pipeline and a wider
#: rasterisation group of the 128 x 256 tile (configurations, not only names: the last two are
#: not in ``CONFIGS``; a winner among them gets an entry there).
SWEEP_TC = ("tc_128x128x64_w2x2_s3", "tc_128x256x64_w2x4_s3", "tc_256x128x64_w4x2_s3",
            gemm_mod.CONFIGS["tc_128x256x64_w2x4_s3"].replace(stages=4),
            gemm_mod.CONFIGS["tc_128x256x64_w2x4_s3"].replace(group_m=16))
SWEEP_SQUARES = [4096, 8192]
SWEEP_SIMT = ("simt_128x128x8_t8x8", "simt_128x128x16_t8x8")
#: (M = 128: the heuristic takes 64x128x64 s4 since 3f6170a's sweep, 0.61-0.70 of cuBLAS, where
#: 128x128x64 s3 gave 0.53-0.71)
SWEEP_LLM = [(2048, 4096, 4096), (128, 4096, 4096), (128, 14336, 4096), (128, 4096, 14336),
             (16, 14336, 4096)]


@dataclasses.dataclass
class Case:
    """One timed row (two with CuPy): ours vs torch.matmul on one shape."""
    case: str
    M: int
    N: int
    K: int
    dtype: str
    config: object = None
    cupy: bool = True

    def config_name(self):
        c = self.config
        return None if c is None else c if isinstance(c, str) else c.name


def plan(args):
    """Every case this run times, in order."""
    cases = []
    if not args.only_sweep:
        for n in (TARGET_SQUARES if args.quick else SQUARES):
            cases += [Case(f"square {n}", n, n, n, dt) for dt in DTYPES]
        llm = QUICK_LLM if args.quick else [(M, N, K) for M in LLM_M for N, K in LLM_NK]
        for M, N, K in llm:
            cases += [Case(f"llm M={M}", M, N, K, dt) for dt in DTYPES]
        for n in ([4096] if args.quick else SIMT_SQUARES):
            cases.append(Case(f"simt fp32 square {n}", n, n, n, "float32", cupy=False))
        if not args.no_linked:
            timed_fp16 = {(c.M, c.N, c.K) for c in cases if c.dtype == "float16"}
            cases += [Case("llm (linked pair)", *s, "float16", cupy=False)
                      for s in LINKED_SHAPES if s not in timed_fp16]
    if args.sweep or args.only_sweep:
        for n in SWEEP_SQUARES:
            for dt in DTYPES:
                cases += [Case(f"sweep {_name(c)}", n, n, n, dt, config=c, cupy=False)
                          for c in SWEEP_TC]
        cases += [Case(f"sweep {c}", 4096, 4096, 4096, "float32", config=c, cupy=False)
                  for c in SWEEP_SIMT]
        if not args.quick:
            for M, N, K in SWEEP_LLM:
                cases += [Case(f"sweep {c}", M, N, K, "float16", config=c, cupy=False)
                          for c in (SMALL_M_CANDIDATES if M <= 32 else LARGE_CANDIDATES)]
    return cases


def _name(config):
    return config if isinstance(config, str) else config.name


def tflops(M, N, K, timing):
    return 2.0 * M * N * K / (timing["median"] * 1e-3) / 1e12


def timed(fn, eager):
    """(timing dict, how) for ``fn``: graph replay unless ``eager`` or capture fails."""
    replay = None if eager else graphed(fn)
    if replay is None:
        return time_gpu(fn), "eager"
    return time_gpu(replay), "graph"


def make_inputs(M, N, K, dtype, seed=0):
    import torch

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(K, N, device="cuda", dtype=dtype, generator=g)
    return a, b


def bench_case(results, c, args):
    """Time ours and the baselines on one case; returns our timing."""
    import torch

    M, N, K = c.M, c.N, c.K
    a, b = make_inputs(M, N, K, c.dtype)
    out = torch.empty(M, N, device="cuda", dtype=a.dtype)
    ref = torch.empty(M, N, device="cuda", dtype=a.dtype)
    if args.autotune and c.config is None:
        t0 = time.perf_counter()
        best = autotune_mod.autotune(a, b, out=out)
        print(f"  autotuned {c.case} {c.dtype}: {best.name} ({time.perf_counter() - t0:.0f} s)")
    ours, how = timed(lambda: gemm(a, b, out=out, config=c.config), args.eager)
    base, _ = timed(lambda: torch.matmul(a, b, out=ref), args.eager)
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() or 1.0
    note = f"{how}; max |ours - torch| / max |torch| = {err / scale:.2e}"
    if c.dtype == "float32":
        note += "; TF32 off"
    shape = f"{M}x{N}x{K}"
    results.add("gemm", c.case, shape, c.dtype, ours, "torch.matmul", base, "TFLOP/s",
                tflops(M, N, K, ours), tflops(M, N, K, base), note=note)
    if c.cupy and c.dtype == "float16":
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            ca, cb = cupy.asarray(a), cupy.asarray(b)
            cout = cupy.asarray(ref)

            def cupy_call():
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    cupy.matmul(ca, cb, out=cout)

            cbase, how_c = timed(cupy_call, args.eager)
            results.add("gemm", c.case, shape, c.dtype, ours, "cupy.matmul", cbase, "TFLOP/s",
                        tflops(M, N, K, ours), tflops(M, N, K, cbase), note=how_c)
    return ours


# ---- parallel compilation --------------------------------------------------------------------

def _lock_cache_writes():
    """Serialise numba's disk-cache writes across processes: ``IndexDataCacheFile.save`` reads
    the index, picks the first free data-file number and writes both back, so two processes
    saving variants of one kernel at once could lose an entry or, worse, pair one variant's key
    with the other's data file."""
    import fcntl

    from numba.cuda.core import caching

    save = caching.IndexDataCacheFile.save

    def locked_save(self, key, data):
        with open(self._index_path + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    caching.IndexDataCacheFile.save = locked_save


def compile_worker(spec):
    """Child process: run each case once (compiling its kernels into the disk cache)."""
    import torch

    _lock_cache_writes()
    for M, N, K, dtype, config in json.loads(spec):
        a, b = make_inputs(M, N, K, dtype)
        cfg = gemm_mod.GemmConfig(**config) if isinstance(config, dict) else config
        gemm(a, b, out=torch.empty(M, N, device="cuda", dtype=a.dtype), config=cfg)
        torch.cuda.synchronize()


def _kernel_key(c):
    """What decides the kernels a case compiles (so each is compiled once): the configuration
    (the heuristic's when none is given), the dtype, and whether it splits K."""
    backend = "simt" if c.dtype == "float32" else "tensor_core"
    cfg = c.config
    if cfg is None:
        cfg = gemm_mod.heuristic(backend, c.M, c.N, c.K)
    elif isinstance(cfg, str):
        cfg = gemm_mod.resolve_config(cfg)
    return cfg.replace(split_k=None), c.dtype, gemm_mod.split_count(cfg, c.M, c.N, c.K) > 1


def precompile(cases, workers):
    """Compile the kernels of ``cases`` in ``workers`` child processes, in parallel."""
    first = {}
    for c in cases:
        first.setdefault(_kernel_key(c), c)
    tasks = [[c.M, c.N, c.K, c.dtype, c.config if c.config is None or isinstance(c.config, str)
              else dataclasses.asdict(c.config)] for c in first.values()]
    run_compile_workers(os.path.abspath(__file__), tasks, workers, "kernel sets")


def run_compile_workers(script, tasks, workers, what):
    """Run ``script --compile-worker JSON`` in ``workers`` child processes, each with every
    ``workers``-th task, and wait for them (a failed worker is reported: the caller then
    compiles what is missing itself)."""
    workers = max(1, min(workers, len(tasks)))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        procs = []
        for w in range(workers):
            # stderr to a file: a full pipe would block the child
            log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
            spec = json.dumps(tasks[w::workers])
            procs.append((subprocess.Popen([sys.executable, script, "--compile-worker", spec],
                                           stdout=subprocess.DEVNULL, stderr=log), log))
        for p, log in procs:
            if p.wait():  # not fatal: this process compiles what is missing
                log.seek(0)
                print(f"  compile worker failed (rc={p.returncode}): {log.read()[-600:]}")
    print(f"compiled {len(tasks)} {what} in {workers} processes: "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


# ---- the linked PTX backend --------------------------------------------------------------------

def linked_worker():
    """Child process (linked backend): compile and warm up LINKED_SHAPES, print READY, wait for a
    line on stdin (the parent is idle then), time them, print JSON."""
    import torch

    from llmspeed_numba import ptx

    calls = []
    for M, N, K in LINKED_SHAPES:
        a, b = make_inputs(M, N, K, "float16")
        o = torch.empty(M, N, device="cuda", dtype=torch.float16)
        fn = (lambda a=a, b=b, o=o: gemm(a, b, out=o))
        calls.append(((M, N, K), fn, graphed(fn)))
    torch.cuda.synchronize()
    print("READY", flush=True)
    sys.stdin.readline()
    out = {"backend": ptx.BACKEND, "rows": []}
    for shape, fn, replay in calls:
        how = "eager" if replay is None else "graph"
        out["rows"].append([*shape, time_gpu(fn if replay is None else replay), how])
    print("LINKED_JSON " + json.dumps(out), flush=True)


class LinkedChild:
    """The linked-backend child: started early, compiles alongside, times when asked."""

    def __init__(self):
        env = dict(os.environ, LLMSPEED_NUMBA_PTX_BACKEND="linked")
        # stderr to a file: a full pipe would block the child
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed by close())
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                      "--linked-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.ready = False

    def _fail(self, why):
        self.log.seek(0)
        print(f"linked backend: skipped ({why}): {self.log.read()[-600:]}")
        self.close()

    def wait_ready(self, timeout=900):
        """Block until the child has compiled and warmed up (it is then idle)."""
        deadline = time.perf_counter() + timeout
        while True:
            left = deadline - time.perf_counter()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self._fail("no READY in time")
                return False
            line = self.proc.stdout.readline()
            if not line:
                self._fail(f"exited, rc={self.proc.wait()}")
                return False
            if line.startswith("READY"):
                self.ready = True
                return True

    def run(self, timeout=300):
        """Let it time its shapes (this process waits); returns its JSON or None."""
        if not self.ready:
            return None
        try:
            out, _ = self.proc.communicate("go\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self._fail("timed out")
            return None
        line = [x for x in out.splitlines() if x.startswith("LINKED_JSON ")]
        if self.proc.returncode or not line:
            self._fail(f"rc={self.proc.returncode}")
            return None
        data = json.loads(line[0][len("LINKED_JSON "):])
        if data["backend"] != "linked":
            print(f"linked backend: skipped (the child ran {data['backend']!r})")
            return None
        return data

    def close(self):
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()
        self.log.close()


def add_linked_rows(results, data, intrinsic_times):
    for M, N, K, t, how in data["rows"]:
        ours = intrinsic_times.get((M, N, K))
        if ours is not None:
            results.add("gemm", "intrinsic vs linked backend", f"{M}x{N}x{K}", "float16", ours,
                        "linked backend", t, "TFLOP/s", tflops(M, N, K, ours),
                        tflops(M, N, K, t), note=how)


# ---- main ------------------------------------------------------------------------------------

def headline(results, path):
    """Markdown table of the ratios to cuBLAS (torch.matmul) for the README."""
    lines = ["| case | shape | dtype | ours TFLOP/s | cuBLAS TFLOP/s | ratio |",
             "|---|---|---|---|---|---|"]
    for r in results.rows:
        if r["baseline"] == "torch.matmul" and not r["case"].startswith("sweep"):
            lines.append(f"| {r['case']} | {r['shape']} | {r['dtype']} | {r['ours_value']} | "
                         f"{r['baseline_value']} | {r['ratio']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="target shapes only")
    parser.add_argument("--eager", action="store_true", help="time plain calls, no CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time the candidates")
    parser.add_argument("--only-sweep", action="store_true", help="time the candidates only")
    parser.add_argument("--autotune", action="store_true", help="autotune each shape first")
    parser.add_argument("--no-linked", action="store_true", help="skip the linked backend")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="parallel compile processes (0: compile in this process)")
    parser.add_argument("--linked-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.linked_worker:
        linked_worker()
        return 0
    if args.compile_worker:
        compile_worker(args.compile_worker)
        return 0

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline: plain fp32 FMA
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    results = Results("gemm")
    print(f"GPU: {results.gpu}; commit {results.commit}; autotune cache "
          f"{autotune_mod.cache_path()}", flush=True)
    cases = plan(args)
    linked = None if args.no_linked or args.only_sweep else LinkedChild()
    try:
        if args.workers > 0 and not args.autotune:
            precompile(cases, args.workers)
        if linked is not None:
            linked.wait_ready()
        print(f"timing {len(cases)} cases ({time.perf_counter() - start:.0f} s so far)",
              flush=True)
        intrinsic_times = {}
        for c in cases:
            try:
                t = bench_case(results, c, args)
            except Exception as exc:  # noqa: BLE001  (a config that does not fit: go on)
                print(f"  {c.case} {c.M}x{c.N}x{c.K} {c.dtype}: {type(exc).__name__}: {exc}")
                continue
            if c.dtype == "float16" and c.config is None:
                intrinsic_times[(c.M, c.N, c.K)] = t
        if linked is not None:
            data = linked.run()
            if data is not None:
                add_linked_rows(results, data, intrinsic_times)
    finally:
        if linked is not None:
            linked.close()
    path = results.write()
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    headline(results, os.path.join(os.path.dirname(path), "gemm_headline.md"))
    print(f"plot: {plot_csv(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
