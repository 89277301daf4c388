"""The streaming 4-bit kernel of ``quant_gemm`` (``_quant_stream``) against the decode (SIMT) and
Tensor Core kernels it replaces at M <= 16, and bf16 cuBLAS on the dequantized weight, same run:
CUDA-graph replay, L2 flushed (``_harness.time_gpu``). Each case's stream result is checked
against float64 ``x @ w_deq.T``. ``--tune`` also times other ring depths, block widths and
split targets at two shapes. One line a case (us, and the ratio cuBLAS / ours); CSV rows of
every timing to ``$OUT/quant_stream.csv`` (or benchmarks/results/).

    python benchmarks/probes/probe_quant_stream.py [--m 1,2,4,8,16] [--tune]

``--compile-only``: call every kernel the timed run would (each M given, both formats, the
tuning knobs, split or not) once on a small weight and exit: run one such process per M in
parallel first, so the timed run loads every kernel from numba's disk cache (a streaming kernel
takes 10-35 s to compile).
"""

import argparse
import csv
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import back_to_back_ms, graphed, time_gpu

import llmspeed_numba as lsn
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import quant_gemm as _quant_gemm  # noqa: F401  (its knobs)

SHAPES = "4096x4096,14336x4096,4096x14336,128256x4096"
PATHS = {   # name: quant_gemm knobs
    "stream": {},
    "decode": {"stream_max_m": 0, "decode_max_m": 16},
    "tc": {"stream_max_m": 0, "decode_max_m": 0},
}
TUNE = [{"stream_stages": s} for s in (3, 6, 8)] + [{"stream_warps": 8}, {"stream_warps": 2}] + [
    {"stream_blocks_per_sm": b} for b in (2, 4, 6)]


def _us(fn):
    fn()
    return 1e3 * time_gpu(graphed(fn))["median"]


def _us_streamed(make_call, nbytes, min_bytes=256 << 20, max_copies=16):
    """us a call inside a steady stream of calls, as in a model's decode graph: one CUDA graph
    of calls cycling over enough copies of the weight (``make_call()`` builds one copy's call)
    that together they outgrow the L2, replayed back to back (no flush, no launch gap)."""
    copies = min(max_copies, max(1, -(-min_bytes // nbytes)))
    calls = [make_call() for _ in range(copies)]
    replay = graphed(lambda: [c() for c in calls])
    return 1e3 * sorted(back_to_back_ms(replay, calls=20, rounds=5))[2] / copies


def compile_only(args):
    """Each kernel of the timed run called once on 4096 x 4096 (split K) and with one split."""
    import torch

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    for fmt in args.formats.split(","):
        group, symmetric = (128, True) if fmt == "int4g128" else (32, False)
        qw = lsn.quantize_weight(w, "int4", group_size=group, symmetric=symmetric, kind="torch")
        for M in map(int, args.m.split(",")):
            x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
            knob_sets = list(PATHS.values()) + (TUNE if args.tune and M in (1, 16) else [])
            for knobs in knob_sets:
                for splits in (None, 1):
                    with overrides(quant_gemm={**knobs, "splits": splits}):
                        lsn.quant_gemm(x, qw)
    torch.cuda.synchronize()
    print(f"compiled: M {args.m}")
    return 0


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,2,4,8,16")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--formats", default="int4g128,int4g32z")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--splits", default="",
                        help="comma-separated split counts also timed on the stream kernel "
                             "(the plan's choice against each)")
    parser.add_argument("--streamed", action="store_true",
                        help="also time stream and cuBLAS inside a back-to-back stream of calls "
                             "over weight copies that outgrow the L2 (decode's steady state)")
    args = parser.parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    commit = os.environ.get("LLMSPEED_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False).stdout.strip()
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    rows = []
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        torch.manual_seed(N + K)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for fmt in args.formats.split(","):
            if fmt != "int4g128" and N * K > 4096 * 14336:
                continue
            group, symmetric = (128, True) if fmt == "int4g128" else (32, False)
            qw = lsn.quantize_weight(w, "int4", group_size=group, symmetric=symmetric,
                                     kind="torch")
            w_deq = torch.from_numpy(qw.dequantize()).to("cuda")
            w_bf16 = w_deq.to(torch.bfloat16)
            for M in map(int, args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                ref = (x.double() @ w_deq.double().T)
                us = {"cublas": _us(lambda x=x, w=w_bf16, out=out: torch.matmul(x, w.T, out=out))}
                err = None
                for path, knobs in PATHS.items():
                    with overrides(quant_gemm=knobs):
                        us[path] = _us(lambda x=x, qw=qw, out=out: lsn.quant_gemm(x, qw, out=out))
                        if path == "stream":
                            lsn.quant_gemm(x, qw, out=out)
                            torch.cuda.synchronize()
                            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                if args.tune and M in (1, 16) and shape in ("4096x14336", "14336x4096",
                                                            "4096x4096"):
                    for knobs in TUNE:
                        with overrides(quant_gemm=knobs):
                            name = "stream " + ",".join(f"{k[7:]}={v}" for k, v in knobs.items())
                            us[name] = _us(lambda x=x, qw=qw, out=out: lsn.quant_gemm(x, qw,
                                                                                     out=out))
                for n in filter(None, args.splits.split(",")):
                    with overrides(quant_gemm={"splits": int(n)}):
                        try:
                            us[f"stream splits={n}"] = _us(
                                lambda x=x, qw=qw, out=out: lsn.quant_gemm(x, qw, out=out))
                        except ValueError:   # x of a split too large for shared memory
                            pass
                if args.streamed:
                    def quant_call(x=x, out=out):
                        q = lsn.quantize_weight(w, "int4", group_size=group,
                                                symmetric=symmetric, kind="torch")
                        return lambda: lsn.quant_gemm(x, q, out=out)

                    def cublas_call(x=x, out=out):
                        wc = w_bf16.clone()
                        return lambda: torch.matmul(x, wc.T, out=out)

                    us["stream_b2b"] = _us_streamed(quant_call, qw.nbytes())
                    us["cublas_b2b"] = _us_streamed(cublas_call, w_bf16.nbytes)
                    torch.cuda.empty_cache()
                best = min((p for p in us if not p.startswith("cublas")), key=us.get)
                line = " ".join(f"{p} {t:.1f}" for p, t in us.items())
                streamed = (f", streamed {us['cublas_b2b'] / us['stream_b2b']:.2f}x"
                            if args.streamed else "")
                print(f"{fmt} {M}x{N}x{K}: {line} | stream {us['cublas'] / us['stream']:.2f}x "
                      f"cuBLAS{streamed}, best {best} | stream err {err:.1e}", flush=True)
                gbs = qw.nbytes() / (us["stream"] * 1e-6) / 1e9
                for p, t in us.items():
                    base = us["cublas_b2b" if p.endswith("_b2b") else "cublas"]
                    rows.append([commit, fmt, M, N, K, p, f"{t:.2f}",
                                 f"{base / t:.3f}", f"{gbs:.0f}", f"{err:.2e}"])
            del qw, w_deq, w_bf16
    path = os.path.join(out_dir, "quant_stream.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["commit", "format", "M", "N", "K", "path", "us", "cublas_over_path",
                             "stream_weight_GBps", "stream_rel_err"])
        writer.writerows(rows)
    print(f"wrote {path}")
    print(f"plot: {plot(path, commit)}")
    return 0


def plot(path, commit):
    """speedup over cuBLAS against M, one panel a weight shape, one line a path (the format of
    groups of 128, ``commit``'s rows): the PNG beside the CSV."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["commit"] == commit and r["format"] == "int4g128"
                and r["path"] in (*PATHS, "stream_b2b")]
    shapes = sorted({(int(r["N"]), int(r["K"])) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.4), squeeze=False)
    for ax, (N, K) in zip(axes[0], shapes):
        for p in (*PATHS, "stream_b2b"):
            pts = sorted((int(r["M"]), float(r["cublas_over_path"])) for r in rows
                         if (int(r["N"]), int(r["K"])) == (N, K) and r["path"] == p)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=p)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(3.0, color="red", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"N x K = {N} x {K}", fontsize=9)
        ax.set_xlabel("M")
    axes[0][0].set_ylabel("bf16 cuBLAS time / ours")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"quant_gemm int4 g128 paths, H200, {commit} (red: issue 21's 3x)", fontsize=10)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    sys.exit(main())
