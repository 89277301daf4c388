"""The decode step's fused launches against the pairs of launches they replace, on the GPU.

    python benchmarks/bench_decode_fusions.py [--tokens 1,16,64,256,8192] [--m 1,4,16]

- ``rotary_kv_append`` (Llama-3-8B attention: 32 q heads, 8 kv heads, head dim 128, bf16, pages
  of 16 tokens) against ``rotary_embedding`` followed by ``paged_kv_append`` of the same tokens;
- the gated ``quant_gemm`` (int4 groups of 128, gate / up interleaved, 28672 x 4096: Llama-3-8B's
  MLP) against ``quant_gemm`` followed by ``silu_and_mul``;
- ``quant_gemm_rms_norm`` (int4 g128, the down projection 4096 x 14336 and the output one
  4096 x 4096, then the next add + RMSNorm), fused at every M (the op fuses only up to
  ``quant_gemm.FUSED_NORM_MAX_M`` rows: these rows say where the limit belongs), against
  ``quant_gemm`` followed by ``rms_norm`` with the residual.

Each side is captured in one CUDA graph and replayed (``_harness.time_gpu``: L2 flushed before
each replay, median of 20), so the difference is the second launch's kernel and the gap between
the two, as a decode graph pays them. Before timing, both sides' outputs are compared (bitwise for
the rotary pair; within the half-precision rounding of the intermediate for the GEMM, whose
unfused side rounds gate / up to bf16 before ``silu_and_mul``). Rows go to ``fusions.csv`` (in
``$OUT`` or ``benchmarks/results/``) as each is measured, with a PNG at the end.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, graphed, plot_csv, time_gpu  # noqa: E402

HEADS, KV_HEADS, HEADDIM, PAGE = 32, 8, 128, 16
HIDDEN, INTER = 4096, 14336


def _timed(fn):
    replay = graphed(fn)
    return time_gpu(replay or fn), "graph" if replay else "eager"


def rotary_case(tokens):
    """(fused, pair, check) at ``tokens`` new tokens, one a sequence, positions up to 4096:
    token t's page at its position is page t (the rest of its row is -1, never read)."""
    import torch

    from llmspeed_numba import paged_kv_append, rotary_embedding, rotary_kv_append

    dev = "cuda"
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEADDIM, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    kc = torch.zeros(tokens, PAGE, KV_HEADS, HEADDIM, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    positions = torch.randint(0, 4096, (tokens,), device=dev, dtype=torch.int32)
    tables = torch.full((tokens, 4096 // PAGE), -1, device=dev, dtype=torch.int32)
    rows = torch.arange(tokens, device=dev)
    tables[rows, (positions // PAGE).long()] = rows.to(torch.int32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEADDIM, 2, device=dev, dtype=torch.float64)
                              / HEADDIM))
    angles = torch.arange(4096, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)

    def fused():
        rotary_kv_append(q, k, v, kc, vc, tables, positions, cos_sin_cache=cos_sin)

    def pair():
        rotary_embedding(q, k, positions, cos_sin_cache=cos_sin, check_bounds=False)
        paged_kv_append(k.unsqueeze(1), v.unsqueeze(1), kc, vc, tables, positions)

    def check():
        start = qkv.clone()
        fused()
        got = (qkv.clone(), kc.clone(), vc.clone())
        qkv.copy_(start)
        kc.zero_()
        vc.zero_()
        pair()
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(got, (qkv, kc, vc)))
        return "bitwise equal" if same else "DIFFERENT"

    return fused, pair, check


def gated_case(m):
    """(fused, pair, check) of the MLP's gate / up projection at ``m`` tokens, int4 g128."""
    import torch

    from llmspeed_numba import interleave_gate_up, quant_gemm, quantize_weight, silu_and_mul

    dev = "cuda"
    gate = torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    up = torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    interleaved = quantize_weight(interleave_gate_up(gate, up), "int4", group_size=128)
    stacked = quantize_weight(torch.cat((gate, up)), "int4", group_size=128)
    x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, INTER, device=dev, dtype=torch.bfloat16)
    out_pair = torch.empty_like(out)
    both = torch.empty(m, 2 * INTER, device=dev, dtype=torch.bfloat16)

    def fused():
        quant_gemm(x, interleaved, activation="silu_and_mul", out=out)

    def pair():
        quant_gemm(x, stacked, out=both)
        silu_and_mul(both, out=out_pair)

    def check():
        fused()
        pair()
        diff = (out.float() - out_pair.float()).abs().max().item()
        scale = out_pair.float().abs().max().item() or 1.0
        return f"max |fused - pair| / max |pair| = {diff / scale:.2e}"

    return fused, pair, check


def norm_case(m, k):
    """(fused, pair, check) of a projection into the residual stream (N = 4096, K = ``k``,
    int4 g128) and the next add + RMSNorm at ``m`` tokens."""
    import torch

    from llmspeed_numba import quant_gemm, quant_gemm_rms_norm, quantize_weight, rms_norm
    from llmspeed_numba._overrides import overrides

    dev = "cuda"
    qw = quantize_weight(torch.randn(HIDDEN, k, device=dev, dtype=torch.bfloat16) * 0.02,
                         "int4", group_size=128)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    start = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
    norm_w = torch.rand(HIDDEN, device=dev, dtype=torch.bfloat16) + 0.5
    residual, residual_pair = start.clone(), start.clone()
    h, h_pair = (torch.empty(m, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2))
    normed, normed_pair = torch.empty_like(h), torch.empty_like(h)

    def fused():    # fused at every M (above FUSED_NORM_MAX_M the op itself takes the pair)
        with overrides(quant_gemm={"fused_norm_max_m": 16}):
            quant_gemm_rms_norm(x, qw, residual, norm_w, 1e-5, out=h, normed=normed)

    def pair():
        quant_gemm(x, qw, out=h_pair)
        rms_norm(h_pair, norm_w, 1e-5, residual=residual_pair, out=normed_pair)

    def check():
        residual.copy_(start)
        residual_pair.copy_(start)
        fused()
        pair()
        same = torch.equal(residual, residual_pair)
        diff = (normed.float() - normed_pair.float()).abs().max().item()
        return f"residual equal: {same}; max |normed - pair| = {diff:.2e}"

    return fused, pair, check


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256,8192",
                        help="rotary_kv_append: comma list of new tokens")
    parser.add_argument("--m", default="1,4,16", help="gated quant_gemm: comma list of M")
    args = parser.parse_args(argv)
    import torch

    results = Results("fusions")
    rows = [("rotary_kv_append", f"{t} tokens h{HEADS}/{KV_HEADS} d{HEADDIM}",
             "rotary_embedding + paged_kv_append", lambda t=t: rotary_case(t))
            for t in map(int, args.tokens.split(","))]
    rows += [("quant_gemm silu_and_mul", f"M{m} int4 g128 {2 * INTER}x{HIDDEN}",
              "quant_gemm + silu_and_mul", lambda m=m: gated_case(m))
             for m in map(int, args.m.split(","))]
    rows += [("quant_gemm_rms_norm", f"M{m} int4 g128 {HIDDEN}x{k}",
              "quant_gemm + rms_norm(residual)", lambda m=m, k=k: norm_case(m, k))
             for k in (HIDDEN, INTER) for m in map(int, args.m.split(","))]
    for op, shape, baseline, make in rows:
        fused, pair, check = make()
        note = check()
        ours, how = _timed(fused)
        base, how_base = _timed(pair)
        results.add(op, shape, shape, "bfloat16", ours, baseline, base, "us",
                    ours["median"] * 1e3, base["median"] * 1e3, note=f"{how}/{how_base}; {note}")
        del fused, pair, check
        torch.cuda.empty_cache()
    print(f"CSV: {results.write()}\nPNG: {plot_csv(results.path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
