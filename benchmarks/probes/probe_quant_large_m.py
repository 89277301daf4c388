"""``quant_gemm`` at prefill sizes: the planned path (dequantize the weight, then ``gemm``, from
``DEQUANT_GEMM_MIN_M``) against the Tensor Core kernel it replaces and bf16 cuBLAS on the
dequantized weight, same run (CUDA-graph replay, L2 flushed); each result checked against the
float64 product. One line a case (us, and cuBLAS / ours); CSV rows to
``$OUT/quant_large_m.csv`` (or benchmarks/results/).

    python benchmarks/probes/probe_quant_large_m.py [--m 64,128,256,2048]
    python benchmarks/probes/probe_quant_large_m.py --plot-only   # the CSV's PNG beside it
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
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG and exit")
    args = parser.parse_args(argv)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    path = os.path.join(out_dir, "quant_large_m.csv")
    if args.plot_only:
        plot(path)
        return 0
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
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["commit", "format", "M", "N", "K", "path", "us", "cublas_over_path"])
        writer.writerows(rows)
    print(f"wrote {path}")
    plot(path)
    return 0


def plot(path):
    """cuBLAS time / ours against M, a panel a (format, N, K): the dequantize-then-gemm path
    of every commit in the CSV, the Tensor Core kernel of the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = list(csv.DictReader(f))
    commits = list(dict.fromkeys(r["commit"] for r in rows))
    cases = sorted({(r["format"], r["N"], r["K"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), sharey=True,
                             squeeze=False)
    for ax, case in zip(axes[0], cases):
        for commit in commits:
            for p, style in (("dequant+gemm", "-o"), ("tc", "--s")):
                if p == "tc" and commit != commits[0]:
                    continue
                pts = sorted((int(r["M"]), float(r["cublas_over_path"])) for r in rows
                             if r["commit"] == commit and r["path"] == p
                             and (r["format"], r["N"], r["K"]) == case)
                if pts:
                    label = f"dequant+gemm {commit}" if p != "tc" else "Tensor Core kernel"
                    ax.plot(*zip(*pts), style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{case[0]} {case[1]}x{case[2]}")
        ax.set_xlabel("M")
        ax.axhline(1, color="gray", lw=0.5)
    axes[0][0].set_ylabel("cuBLAS time / ours (higher is faster)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("quant_gemm at prefill sizes (probe_quant_large_m.py)")
    fig.tight_layout()
    fig.savefig(path.replace(".csv", ".png"), dpi=90)


if __name__ == "__main__":
    sys.exit(main())
