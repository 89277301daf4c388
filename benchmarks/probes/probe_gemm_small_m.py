"""GEMM at the batched-decode shapes (issue 20): every few-row tile and K split against cuBLAS,
the fused epilogue's cost at 8192 x 14336 x 4096, and split-K's bitwise repeatability.

bf16, x (M, K) row-major times a Linear weight W (N, K) (``b = W.T``, the model's layout);
CUDA-graph replay, L2 flushed (``time_gpu``). Prints one line per (shape, config, split) and
the best per shape; rows of the best and of the heuristic go to ``gemm_small_m.csv``.

    python benchmarks/probes/probe_gemm_small_m.py [--m 16,32,64,128,256] [--workers 14]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import Results, copy_bandwidth, graphed, time_gpu  # noqa: E402
import bench_gemm  # noqa: E402

from llmspeed_numba import gemm  # noqa: E402
from llmspeed_numba.ops import gemm_configs  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 4096))
TILES = ("tc_16x128x64_w1x4_s4", "tc_64x128x64_w1x4_s4", "wg_64x128x64_s4", "wg_64x128x64_s6",
         "wg_64x256x64_s3", "wg_64x256x64_s4", "wg_128x128x64_s5", "wg_128x256x64_s4")
SPLITS = (None, 1, 2, 4, 8, 16)


def cases(ms, tiles=TILES, splits=SPLITS, shapes=SHAPES):
    for M in ms:
        for N, K in shapes:
            for tile in tiles:
                if tile.startswith("tc_16") and M > 32:
                    continue
                if M <= 32 and tile.startswith("wg_128"):
                    continue
                for split in splits:
                    yield M, N, K, tile if split is None else f"{tile}_k{split}"


def inputs(M, N, K, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    return x, w


def compile_worker(spec):
    import torch

    bench_gemm._lock_cache_writes()
    for M, N, K, config, variant in json.loads(spec):
        if variant:
            epilogue_variants()[variant]()
        else:
            x, w = inputs(M, N, K)
            gemm(x, w.T, config=config)
        torch.cuda.synchronize()


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,4,16,32,64,128,256")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--compile-worker", help=argparse.SUPPRESS)
    parser.add_argument("--skip-epilogue", action="store_true")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="kernels already cached")
    parser.add_argument("--tiles", help="comma-separated config names (default: TILES)")
    parser.add_argument("--splits", help="comma-separated splits, 'auto' for the heuristic's")
    parser.add_argument("--shapes", help="N:K pairs, comma-separated (default: SHAPES; "
                        "Llama-3-8B's q / k / v projection is 6144:4096)")
    args = parser.parse_args(argv)
    if args.compile_worker:
        compile_worker(args.compile_worker)
        return 0
    ms = [int(m) for m in args.m.split(",")]
    tiles = args.tiles.split(",") if args.tiles else TILES
    splits = tuple(None if x == "auto" else int(x) for x in args.splits.split(",")) \
        if args.splits else SPLITS
    shapes = tuple(tuple(int(x) for x in nk.split(":")) for nk in args.shapes.split(",")) \
        if args.shapes else SHAPES
    all_cases = list(cases(ms, tiles, splits, shapes))
    # one compile task per kernel: (tile, split or not); the heuristic's picks too
    tasks, seen = [], set()
    for M, N, K, cfg in all_cases + [(M, N, K, None) for M in ms for N, K in shapes]:
        c = gemm_configs.resolve_config(cfg) if cfg else gemm_configs.heuristic(
            "tensor_core", M, N, K)
        key = (c.replace(split_k=None), gemm_configs.split_count(c, M, N, K) > 1)
        if key not in seen:
            seen.add(key)
            tasks.append([M, N, K, cfg, None])
    if not args.skip_epilogue:
        tasks += [[0, 0, 0, None, name] for name in EPILOGUE_VARIANTS if "cublas" not in name]
    if not args.no_compile:
        bench_gemm.run_compile_workers(os.path.abspath(__file__), tasks, args.workers, "kernels")
    if args.compile_only:
        return 0

    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    results = Results("gemm_small_m")
    for M in ms:
        for N, K in shapes:
            x, w = inputs(M, N, K)
            out = torch.empty(M, N, device="cuda", dtype=x.dtype)
            ref = x @ w.T
            full = {"cublas": time_gpu(graphed(lambda: torch.matmul(x, w.T, out=out)))}
            t_cublas = full["cublas"]["median"]
            timings = {}
            for cfg in [None] + [c for (m, n, k, c) in all_cases if (m, n, k) == (M, N, K)]:
                fn = lambda: gemm(x, w.T, out=out, config=cfg)  # noqa: E731
                try:
                    fn()
                    err = (out.float() - ref.float()).abs().max().item()
                    full[cfg] = time_gpu(graphed(fn))
                    timings[cfg] = full[cfg]["median"]
                except Exception as exc:  # noqa: BLE001
                    print(f"  {M}x{N}x{K} {cfg}: {type(exc).__name__}: {exc}")
                    continue
                flag = "" if err < 0.05 * ref.float().abs().max().item() else f" BAD err {err}"
                print(f"{M}x{N}x{K} {cfg or 'heuristic'}: {1e3 * timings[cfg]:.1f} us "
                      f"({t_cublas / timings[cfg]:.3f}x cuBLAS){flag}", flush=True)
            if None not in timings or len(timings) < 2:
                continue
            best = min((c for c in timings if c), key=timings.get)
            gbs = 2 * N * K / (timings[None] * 1e-3) / 1e9
            print(f"== {M}x{N}x{K}: cuBLAS {1e3 * t_cublas:.1f} us, heuristic "
                  f"{1e3 * timings[None]:.1f} us ({t_cublas / timings[None]:.3f}x, weights "
                  f"{gbs:.0f} GB/s = {gbs / copy:.2f} of copy), best {best} "
                  f"{1e3 * timings[best]:.1f} us ({t_cublas / timings[best]:.3f}x)", flush=True)
            for name, cfg in (("heuristic", None), (best, best)):
                t = timings[cfg]
                results.add("gemm", f"small M {name}", f"{M}x{N}x{K}", "bfloat16", full[cfg],
                            "torch.matmul", full["cublas"], "GB/s weights",
                            2 * N * K / (t * 1e-3) / 1e9, 2 * N * K / (t_cublas * 1e-3) / 1e9,
                            note=f"copy {copy:.0f} GB/s")
            # a K split adds its partial sums in a fixed order: the same bits every call
            first = gemm(x, w.T).clone()
            for _ in range(3):
                if not torch.equal(gemm(x, w.T), first):
                    print(f"!! {M}x{N}x{K}: heuristic result differs between calls")
    if not args.skip_epilogue:
        epilogue_cost(results)
    return 0


EPILOGUE_VARIANTS = ("plain", "bias", "bias+silu", "bias+gelu", "beta*c", "out fp32",
                     "cublas mm", "cublas addmm+silu")


def epilogue_variants():
    """The calls ``epilogue_cost`` times, on 8192 x 14336 x 4096 fp16 operands."""
    import torch

    M, N, K = 8192, 14336, 4096
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    c = torch.randn(M, N, device="cuda", dtype=torch.float16)
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    out32 = torch.empty(M, N, device="cuda", dtype=torch.float32)
    return {
        "plain": lambda: gemm(x, w.T, out=out),
        "bias": lambda: gemm(x, w.T, bias=bias, out=out),
        "bias+silu": lambda: gemm(x, w.T, bias=bias, activation="silu", out=out),
        "bias+gelu": lambda: gemm(x, w.T, bias=bias, activation="gelu", out=out),
        "beta*c": lambda: gemm(x, w.T, c=c, beta=1.0, out=out),
        "out fp32": lambda: gemm(x, w.T, out=out32),
        "cublas mm": lambda: torch.matmul(x, w.T, out=out),
        "cublas addmm+silu": lambda: torch.nn.functional.silu(torch.addmm(bias, x, w.T)),
    }


def epilogue_cost(results):
    """Plain GEMM vs each fused epilogue at 8192 x 14336 x 4096 fp16, and cuBLAS addmm + silu."""
    M, N, K = 8192, 14336, 4096
    t, full = {}, {}
    variants = epilogue_variants()
    for name, fn in variants.items():
        fn()
        full[name] = time_gpu(graphed(fn), rep=10)
        t[name] = full[name]["median"]
        print(f"epilogue {M}x{N}x{K} {name}: {t[name]:.3f} ms ({t[name] / t['plain']:.3f} of "
              f"plain)" if "plain" in t else f"epilogue {name}: {t[name]:.3f} ms", flush=True)
    for name in ("bias", "bias+silu", "bias+gelu", "beta*c", "out fp32"):
        results.add("gemm", f"epilogue {name}", f"{M}x{N}x{K}", "float16", full[name],
                    "ours plain", full["plain"], "ms", t[name], t["plain"],
                    note=f"cuBLAS addmm+silu {t['cublas addmm+silu']:.3f} ms, mm "
                         f"{t['cublas mm']:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
