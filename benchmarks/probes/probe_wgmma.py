"""The Hopper wgmma GEMM kernel against the mma.sync kernel and cuBLAS, one run (issue 3).

    python benchmarks/probes/probe_wgmma.py [--configs wg_128x256x64_s4,tc_128x256x64_w2x4_s3]
                                     [--shapes 4096,8192] [--dtypes float16,bfloat16]
                                     [--layouts NN,NT] [--rounds 2]

For every square shape, dtype and layout: torch.matmul (cuBLAS) and each configuration (no
split-K), alternated over ``--rounds`` rounds so drift shows. Timing as bench_gemm: CUDA-graph
replays, L2 flushed, median of 20 (``_harness.time_gpu``). Each configuration's output is
compared with cuBLAS's (max |ours - cuBLAS| / max |cuBLAS|: a wrong kernel shows at once) before
it is timed. Lines: shape, dtype, layout, name, TFLOP/s per round, ratio of the best round to
cuBLAS's best round.
"""

import argparse
import os
import sys

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))  # the repository root
sys.path.insert(0, _BENCHMARKS)  # _harness and the bench_*.py modules

from _harness import graphed, time_gpu  # noqa: E402

import llmspeed_numba as lib  # noqa: E402


def operand(torch, rows, cols, dtype, col_major):
    """A (rows, cols) operand, column-major as the transposed view of a row-major tensor."""
    if col_major:
        return torch.randn(cols, rows, dtype=dtype, device="cuda").T
    return torch.randn(rows, cols, dtype=dtype, device="cuda")


def main():
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="wg_128x256x64_s4,wg_128x128x64_s5,"
                        "tc_128x256x64_w2x4_s3")
    parser.add_argument("--shapes", default="4096,8192")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--layouts", default="NN")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    torch.manual_seed(0)
    summary = []
    for n in (int(s) for s in args.shapes.split(",")):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for layout in args.layouts.split(","):
                a = operand(torch, n, n, dtype, layout[0] == "T")
                b = operand(torch, n, n, dtype, layout[1] == "T")
                out = torch.empty(n, n, dtype=dtype, device="cuda")
                ref = torch.matmul(a, b)
                scale = ref.abs().max().item()
                fns = {"cublas": lambda: torch.matmul(a, b, out=out)}
                for cfg in configs:
                    got = lib.gemm(a, b, out=out, config=cfg + "_k1")
                    torch.cuda.synchronize()
                    err = (got.float() - ref.float()).abs().max().item() / scale
                    print(f"{n} {dtype_name} {layout} {cfg}: max err / max |ref| {err:.2e}",
                          flush=True)
                    fns[cfg] = (lambda c: lambda: lib.gemm(a, b, out=out, config=c + "_k1"))(cfg)
                replays = {k: graphed(f) or f for k, f in fns.items()}
                rates = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, r in replays.items():
                        ms = time_gpu(r)["median"]
                        rates[k].append(2.0 * n ** 3 / (ms * 1e-3) / 1e12)
                best_ref = max(rates["cublas"])
                for k, v in rates.items():
                    line = (f"{n} {dtype_name} {layout} {k:28s} "
                            + " ".join(f"{x:7.1f}" for x in v)
                            + f"  ratio {max(v) / best_ref:.3f}")
                    print(line, flush=True)
                    summary.append(line)
    print("\n".join(["== summary (TFLOP/s per round, best-round ratio to cuBLAS)"] + summary))


if __name__ == "__main__":
    main()
