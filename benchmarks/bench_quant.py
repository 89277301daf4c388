"""Weight-only quantized GEMM on the GPU: ``quant_gemm`` against bf16 cuBLAS on the (dequantized)
weight and torch's own int4 kernel, same process, same data, same stream.

    python benchmarks/bench_quant.py [--formats int4,int8] [--m 1,4,16,64,256,4096]
        [--shapes 4096x4096,14336x4096,4096x14336,128256x4096] [--group-size 128] [--eager]

Shapes (issue 21): N x K in {4096 x 4096, 14336 x 4096, 4096 x 14336, 128256 x 4096} (Llama-3-8B's
projections and LM head), M in {1, 4, 16, 64, 256, 4096}; x (M, K) bf16, the weight (N, K) in
torch.nn.Linear's layout, quantized once (``quantize_weight``, int4 symmetric groups of 128 along
K, int8 one scale a row). Baselines: ``torch.matmul(x, w.T)`` on the bf16 dequantized weight
(cuBLAS), and, for int4, ``torch._weight_int4pack_mm`` on the same codes (skipped, with the
reason printed, where this torch build has no such kernel for the GPU). Targets (issue 21): int4
at M <= 16 at least 3.0x bf16, M = 64 1.5x, M = 256 0.9x; int8 at M <= 16 1.8x.

FP8 (``fp8_e4m3``, W8A8, Hopper) at M = N = K in ``--fp8-sizes`` (4096, 8192), in TFLOP/s (2 M N
K over the time; ratio = ours / baseline): ``quant_gemm`` (x quantized per token, then the
GEMM) and the GEMM alone on x quantized beforehand (``_fp8_gemm.gemm_quantized``), against
``torch._scaled_mm`` on the same e4m3 codes with row / column scales (torch's rowwise FP8
kernel) and with per-tensor scales (cuBLASLt), and bf16 ``torch.matmul`` (cuBLAS) on the
unquantized operands. Target: the GEMM at least 0.85x cuBLASLt FP8.

Each call is captured in a CUDA graph and the replay is timed (``_harness.time_gpu``: L2 flushed
before each call, median of 20); ``--eager`` times plain calls. Rows go to ``quant.csv`` (in
``$OUT`` or ``benchmarks/results/``), unit ms, ratio = baseline time / ours (above 1: ours is
faster); the note has our packed weight's bytes over our time (GB/s) and the largest difference
between our result and cuBLAS's on the dequantized weight, relative to its largest value.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, graphed, plot_csv, time_gpu

from llmspeed_numba import quant_gemm, quantize_weight
from llmspeed_numba._overrides import overrides

M_VALUES = (1, 4, 16, 64, 256, 4096)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
FORMATS = ("int4", "int8", "fp8_e4m3")
FP8_SIZES = (4096, 8192)


def timed(fn, eager):
    replay = None if eager else graphed(fn)
    return time_gpu(fn if replay is None else replay), "eager" if replay is None else "graph"


def make_weight(N, K, fmt, group_size):
    """(QuantizedWeight, its bf16 dequantized copy on the GPU)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(N * 7 + K)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    qw = quantize_weight(w, fmt, group_size=group_size, kind="torch")
    del w
    w_deq = torch.from_numpy(qw.dequantize()).to("cuda", torch.bfloat16)
    return qw, w_deq


def int4pack_baseline(qw, x):
    """``torch._weight_int4pack_mm`` on qw's codes (symmetric int4): a callable, or the reason
    it cannot run here."""
    import torch

    if qw.bits != 4 or qw.mode != "const":
        return "needs symmetric int4"
    try:
        q = torch.from_numpy(qw.codes()).to("cuda", torch.int32)                  # (N, K)
        packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(packed_u8, 8)
        scales = qw.scales.to(torch.bfloat16)                                      # (K / G, N)
        # torch's form: w = (q - 8) * scale + zero; here zero = 0
        sz = torch.stack((scales, torch.zeros_like(scales)), dim=-1).contiguous()
        group = qw.group_size

        def call():
            return torch._weight_int4pack_mm(x, packed, group, sz)

        call()
        torch.cuda.synchronize()
        return call
    except Exception as exc:  # noqa: BLE001  (reported, the row is skipped)
        return f"{type(exc).__name__}: {exc}"


def bench_case(results, N, K, M, fmt, qw, w_deq, eager):
    import torch

    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def ours():
        quant_gemm(x, qw, out=out)

    def cublas():
        torch.matmul(x, w_deq.T, out=ref)

    t_ours, how = timed(ours, eager)
    t_bf16, _ = timed(cublas, eager)
    ours()
    cublas()
    torch.cuda.synchronize()
    diff = (out.float() - ref.float()).abs().max().item() / (ref.float().abs().max().item() or 1)
    gbs = qw.nbytes() / (t_ours["median"] * 1e-3) / 1e9
    note = f"{how}; weights {gbs:.0f} GB/s; max |ours - cuBLAS| / max |cuBLAS| = {diff:.2e}"
    case = f"M={M} {fmt}"
    shape = f"{M}x{N}x{K}"
    results.add("quant_gemm", case, shape, "bfloat16", t_ours, "torch bf16 matmul", t_bf16,
                "ms", t_ours["median"], t_bf16["median"], note=note)
    if fmt == "int4":
        baseline = int4pack_baseline(qw, x)
        if isinstance(baseline, str):
            print(f"  {case} {shape}: torch._weight_int4pack_mm skipped: {baseline}", flush=True)
        else:
            t_int4, _ = timed(baseline, eager)
            results.add("quant_gemm", case, shape, "bfloat16", t_ours,
                        "torch _weight_int4pack_mm", t_int4, "ms", t_ours["median"],
                        t_int4["median"], note=note)


def fp8_operands(S):
    """bf16 x and w (S x S), w quantized (``quantize_weight``), and torch's e4m3 copies of the
    same codes for ``torch._scaled_mm``: (x, w, qw, xq, sx, wq, sw)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(S)
    w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(S, S, device="cuda", dtype=torch.bfloat16, generator=g)
    qw = quantize_weight(w, "fp8_e4m3", kind="torch")
    x32 = x.float()
    sx = x32.abs().amax(dim=1, keepdim=True) / 448.0                      # (M, 1), as ours
    xq = (x32 / torch.where(sx == 0, torch.ones_like(sx), sx)).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    wq = qw.qweight.view(torch.float8_e4m3fn)                             # (N, K) row-major
    return x, w, qw, xq, sx, wq, qw.scales.reshape(1, S).contiguous()


def bench_fp8(results, S, eager, tiles=()):
    import torch

    from llmspeed_numba._arrays import stream_handle
    from llmspeed_numba._checks import tensor
    from llmspeed_numba.ops import _fp8_gemm

    x, w, qw, xq, sx, wq, sw = fp8_operands(S)
    out = torch.empty(S, S, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty(S, S, device="cuda", dtype=torch.bfloat16)
    tx, to = tensor(x, "x"), tensor(out, "out")
    codes16, row_scale = _fp8_gemm.quantize_activations(tx, stream_handle(None, (tx,)))
    one = torch.ones((), device="cuda", dtype=torch.float32)

    def tflops(t):
        return 2.0 * S ** 3 / (t["median"] * 1e-3) / 1e12

    calls = {
        "ours quant_gemm": lambda: quant_gemm(x, qw, out=out),
        "ours GEMM only": lambda: _fp8_gemm.gemm_quantized(
            codes16, row_scale, S, qw, None, to, "bfloat16", None, stream_handle(None, (tx,))),
    }
    baselines = {
        "torch _scaled_mm rowwise": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16),
        "cuBLASLt _scaled_mm tensorwise": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "torch bf16 matmul": lambda: torch.matmul(x, w.T, out=ref),
    }
    times = {name: timed(fn, eager) for name, fn in calls.items()}
    for tile in tiles:   # other GEMM tiles, same run (``_fp8_gemm.TUNING``)
        with overrides(fp8_gemm={"tile": tile}):
            times[f"ours GEMM only {_tile_name(tile)}"] = timed(calls["ours GEMM only"], eager)
    calls["ours quant_gemm"]()
    rowwise = None
    for name, fn in baselines.items():
        try:
            result = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  (reported, the row is skipped)
            print(f"  fp8 {S}^3: {name} skipped: {type(exc).__name__}: {exc}", flush=True)
            continue
        if name.endswith("rowwise"):
            rowwise = result
        t_base, _ = timed(fn, eager)
        for ours_name, (t_ours, how) in times.items():
            note = how
            if rowwise is not None:
                diff = ((out.float() - rowwise.float()).abs().max().item()
                        / (rowwise.float().abs().max().item() or 1))
                note += f"; max |ours - _scaled_mm rowwise| / max = {diff:.2e}"
            results.add("quant_gemm_fp8", f"{ours_name} vs {name}", f"{S}x{S}x{S}", "bfloat16",
                        t_ours, name, t_base, "TFLOP/s", tflops(t_ours), tflops(t_base),
                        note=note)


def _tile_name(tile):
    return "{}x{}s{}".format(*tile[:3])


def _tile(text):
    """"128x256s4" -> (block_m, block_n, stages, group_m 8)."""
    mn, stages = text.lower().split("s")
    m, n = mn.split("x")
    return int(m), int(n), int(stages), 8


def _csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def _shape(text):
    n, k = text.lower().split("x")
    return int(n), int(k)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", type=_csv(str), default=list(FORMATS),
                        help="int4, int8 and / or fp8_e4m3")
    parser.add_argument("--m", type=_csv(int), default=list(M_VALUES), help="rows of x")
    parser.add_argument("--shapes", type=_csv(_shape), default=list(SHAPES),
                        help="weight shapes NxK, comma separated")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size along K")
    parser.add_argument("--fp8-sizes", type=_csv(int), default=list(FP8_SIZES),
                        help="M = N = K of the fp8_e4m3 rows")
    parser.add_argument("--fp8-tiles", type=_csv(_tile), default=[],
                        help="extra FP8 GEMM tiles to time beside the default, e.g. "
                             "128x128s5,64x256s4 (block_m x block_n, stages)")
    parser.add_argument("--eager", action="store_true", help="time plain calls, no CUDA graph")
    args = parser.parse_args()
    start = time.perf_counter()
    results = Results("quant")
    print(f"GPU: {results.gpu}; commit {results.commit}", flush=True)
    if "fp8_e4m3" in args.formats:
        for S in args.fp8_sizes:
            try:
                bench_fp8(results, S, args.eager, args.fp8_tiles)
            except Exception as exc:  # noqa: BLE001  (report and go on)
                print(f"  fp8 {S}^3: {type(exc).__name__}: {exc}", flush=True)
    for N, K in args.shapes:
        for fmt in (f for f in args.formats if f != "fp8_e4m3"):
            t0 = time.perf_counter()
            qw, w_deq = make_weight(N, K, fmt, args.group_size)
            print(f"{fmt} {N}x{K}: quantized in {time.perf_counter() - t0:.0f} s", flush=True)
            for M in args.m:
                try:
                    bench_case(results, N, K, M, fmt, qw, w_deq, args.eager)
                except Exception as exc:  # noqa: BLE001  (report and go on)
                    print(f"  M={M} {fmt} {N}x{K}: {type(exc).__name__}: {exc}", flush=True)
            del qw, w_deq
    path = results.write()
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    print(f"plot: {plot_csv(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
