"""GEMM on the GPU, side by side with cuBLAS through ``torch.matmul`` (and CuPy where installed),
same process, same data, same stream.

    python benchmarks/bench_gemm.py [--quick] [--eager] [--sweep] [--autotune] [--no-linked]

- Tensor Core fp16 / bf16: squares 1024..8192 and LLM shapes M in {1, 16, 128, 2048, 8192} x
  (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}; row-major a (M, K) and b (K, N).
- SIMT fp32 against torch fp32 with TF32 off.
- The ``@intrinsic`` PTX backend against the linked backend (a child process with
  ``LLMSPEED_NUMBA_PTX_BACKEND=linked``; skipped when that backend is missing or fails).
- ``--sweep``: the autotuner's Tensor Core candidates (``LARGE_CANDIDATES`` /
  ``SMALL_M_CANDIDATES``) on a few headline shapes (``--quick``: 4096^3 only).
- ``--autotune``: autotune each shape first (slow: compiles every candidate), so the rows show
  the tuned winners; the winners stay in the autotune cache (``$LLMSPEED_NUMBA_CACHE``).

TFLOP/s = 2 * M * N * K / time. Each call is captured once in a CUDA graph and the graph replay
is timed (``time_gpu``: L2 flushed before each call, median of 20): the kernels' time without
Python launch overhead, for ours and the baselines alike (``--eager`` times plain calls, which
for decode shapes mostly measures the host). Rows go to ``gemm.csv`` in ``$OUT`` or
``benchmarks/results/`` with a PNG beside it, and the headline ratios to ``gemm_headline.md``.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, graphed, plot_csv, time_gpu

from llmspeed_numba.ops.gemm import LARGE_CANDIDATES, SMALL_M_CANDIDATES, gemm

# the module (the package may export the function ``autotune`` under the same name)
autotune_mod = importlib.import_module("llmspeed_numba.autotune")

SQUARES = [1024, 2048, 4096, 8192]
LLM_M = [1, 16, 128, 2048, 8192]
LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336)]
SIMT_SQUARES = [1024, 2048, 4096]
LINKED_SHAPES = [(4096, 4096, 4096), (16, 4096, 4096)]
SWEEP_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 4096, 4096), (128, 4096, 4096),
                (16, 14336, 4096)]


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

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(K, N, device="cuda", dtype=dtype, generator=g)
    return a, b


def bench_case(results, case, M, N, K, dtype, args, config=None, cupy_too=True):
    """Time ours and the baselines on one shape; returns our timing."""
    import torch

    a, b = make_inputs(M, N, K, dtype)
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    ref = torch.empty(M, N, device="cuda", dtype=dtype)
    name = str(dtype).replace("torch.", "")
    if args.autotune and config is None:
        t0 = time.perf_counter()
        best = autotune_mod.autotune(a, b, out=out)
        print(f"  autotuned {case} {name}: {best.name} ({time.perf_counter() - t0:.0f} s)")
    ours, how = timed(lambda: gemm(a, b, out=out, config=config), args.eager)
    base, _ = timed(lambda: torch.matmul(a, b, out=ref), args.eager)
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() or 1.0
    note = f"{how}; max |ours - torch| / max |torch| = {err / scale:.2e}"
    shape = f"{M}x{N}x{K}"
    results.add("gemm", case, shape, name, ours, "torch.matmul", base, "TFLOP/s",
                tflops(M, N, K, ours), tflops(M, N, K, base), note=note)
    if cupy_too and dtype != torch.bfloat16:
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
            results.add("gemm", case, shape, name, ours, "cupy.matmul", cbase, "TFLOP/s",
                        tflops(M, N, K, ours), tflops(M, N, K, cbase), note=how_c)
    return ours


def bench_simt(results, args):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for n in ([4096] if args.quick else SIMT_SQUARES):
        bench_case(results, f"simt fp32 square {n}", n, n, n, torch.float32, args,
                   cupy_too=False)


def linked_worker():
    """Child process (linked backend): time our kernels on LINKED_SHAPES, print JSON."""
    import torch

    from llmspeed_numba import ptx

    out = {"backend": ptx.BACKEND, "rows": []}
    for M, N, K in LINKED_SHAPES:
        a, b = make_inputs(M, N, K, torch.float16)
        o = torch.empty(M, N, device="cuda", dtype=torch.float16)
        t, how = timed(lambda a=a, b=b, o=o: gemm(a, b, out=o), False)
        out["rows"].append([M, N, K, t, how])
    print("LINKED_JSON " + json.dumps(out))


def bench_linked(results, args, intrinsic_times):
    env = dict(os.environ, LLMSPEED_NUMBA_PTX_BACKEND="linked")
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--linked-worker"],
                              capture_output=True, text=True, env=env, timeout=900,
                              check=False)
    except subprocess.TimeoutExpired:
        print("linked backend: timed out, skipped")
        return
    line = [x for x in proc.stdout.splitlines() if x.startswith("LINKED_JSON ")]
    if proc.returncode or not line:
        print(f"linked backend: skipped (rc={proc.returncode}): {proc.stderr[-600:]}")
        return
    data = json.loads(line[0][len("LINKED_JSON "):])
    if data["backend"] != "linked":
        print(f"linked backend: skipped (the child ran {data['backend']!r})")
        return
    for M, N, K, t, how in data["rows"]:
        ours = intrinsic_times.get((M, N, K))
        if ours is None:
            continue
        results.add("gemm", "intrinsic vs linked backend", f"{M}x{N}x{K}", "float16", ours,
                    "linked backend", t, "TFLOP/s", tflops(M, N, K, ours), tflops(M, N, K, t),
                    note=how)


def sweep(results, args):
    import torch

    shapes = SWEEP_SHAPES[:1] if args.quick else SWEEP_SHAPES
    for M, N, K in shapes:
        for name in (SMALL_M_CANDIDATES if M <= 32 else LARGE_CANDIDATES):
            try:
                bench_case(results, f"sweep {name}", M, N, K, torch.float16, args, config=name,
                           cupy_too=False)
            except Exception as exc:  # noqa: BLE001  (a config that does not fit: go on)
                print(f"  sweep {name} {M}x{N}x{K}: {type(exc).__name__}: {exc}")


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
    parser.add_argument("--quick", action="store_true", help="headline shapes only")
    parser.add_argument("--eager", action="store_true", help="time plain calls, no CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="time the TC autotune candidates")
    parser.add_argument("--autotune", action="store_true", help="autotune each shape first")
    parser.add_argument("--no-linked", action="store_true", help="skip the linked backend")
    parser.add_argument("--linked-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.linked_worker:
        linked_worker()
        return 0

    import torch

    start = time.perf_counter()
    results = Results("gemm")
    print(f"GPU: {results.gpu}; commit {results.commit}; autotune cache "
          f"{autotune_mod.cache_path()}")
    intrinsic_times = {}
    dtypes = [torch.float16, torch.bfloat16]
    squares = [4096, 8192] if args.quick else SQUARES
    for n in squares:
        for dt in dtypes:
            t = bench_case(results, f"square {n}", n, n, n, dt, args)
            if dt == torch.float16:
                intrinsic_times[(n, n, n)] = t
    llm_m = [1, 16, 2048] if args.quick else LLM_M
    llm_nk = LLM_NK[:2] if args.quick else LLM_NK
    for M in llm_m:
        for N, K in llm_nk:
            for dt in dtypes:
                t = bench_case(results, f"llm M={M}", M, N, K, dt, args)
                if dt == torch.float16:
                    intrinsic_times[(M, N, K)] = t
    bench_simt(results, args)
    if not args.no_linked:
        missing = [s for s in LINKED_SHAPES if s not in intrinsic_times]
        for M, N, K in missing:
            intrinsic_times[(M, N, K)] = bench_case(results, "llm (linked pair)", M, N, K,
                                                    torch.float16, args, cupy_too=False)
        bench_linked(results, args, intrinsic_times)
    if args.sweep:
        sweep(results, args)
    path = results.write()
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    headline(results, os.path.join(os.path.dirname(path), "gemm_headline.md"))
    print(f"plot: {plot_csv(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
