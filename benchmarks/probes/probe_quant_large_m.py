"""``quant_gemm`` at prefill sizes: the planned path (dequantize the weight, then ``gemm``, from
``DEQUANT_GEMM_MIN_M``) against the Tensor Core kernel it replaces and bf16 cuBLAS on the
dequantized weight, same run (CUDA-graph replay, L2 flushed); each result checked against the
float64 product. One line a case (us, and cuBLAS / ours); CSV rows to
``$OUT/quant_large_m.csv`` (or benchmarks/results/).

    python benchmarks/probes/probe_quant_large_m.py [--m 64,128,256,2048]
"""

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import commit, graphed, time_gpu

import llmspeed_numba as lsn
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import quant_gemm as _quant_gemm  # noqa: F401  (its knobs)

PATHS = {"dequant+gemm": {"dequant_min_m": 1}, "tc": {"dequant_min_m": 1 << 30}}


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="64,128,256,2048")
    parser.add_argument("--shapes", default="4096x14336,14336x4096,28672x4096")
    parser.add_argument("--formats", default="int4g128,int8")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        torch.manual_seed(N + K)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for fmt in args.formats.split(","):
            qw = (lsn.quantize_weight(w, "int4", group_size=128, kind="torch")
                  if fmt == "int4g128" else lsn.quantize_weight(w, "int8", group_size=-1, kind="torch"))
            w_bf16 = torch.from_numpy(qw.dequantize()).to("cuda", torch.bfloat16)
            for M in map(int, args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ w_bf16.float().T
                us = {"cublas": 1e3 * time_gpu(graphed(
                    lambda x=x, out=out: torch.matmul(x, w_bf16.T, out=out)))["median"]}
                errs = []
                for path, knobs in PATHS.items():
                    with overrides(quant_gemm=knobs):
                        def call(x=x, out=out):
                            return lsn.quant_gemm(x, qw, out=out)
                        call()
                        torch.cuda.synchronize()
                        errs.append(((out.float() - ref).abs().max() / ref.abs().max()).item())
                        us[path] = 1e3 * time_gpu(graphed(call))["median"]
                line = " ".join(f"{p} {t:.1f}" for p, t in us.items())
                print(f"{fmt} {M}x{N}x{K}: {line} | dequant+gemm "
                      f"{us['cublas'] / us['dequant+gemm']:.2f}x cuBLAS, tc "
                      f"{us['cublas'] / us['tc']:.2f}x | errs {errs[0]:.1e} {errs[1]:.1e}",
                      flush=True)
                for p, t in us.items():
                    rows.append([commit(), fmt, M, N, K, p, f"{t:.2f}", f"{us['cublas'] / t:.3f}"])
            del qw, w_bf16
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    path = os.path.join(out_dir, "quant_large_m.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["commit", "format", "M", "N", "K", "path", "us", "cublas_over_path"])
        writer.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
