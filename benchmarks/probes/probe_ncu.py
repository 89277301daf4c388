"""One call of an op between cudaProfilerStart / Stop, for Nsight Compute (``ncu
--profile-from-start off``): where a memory-bound kernel's time goes (DRAM throughput, stalls).

    ncu --profile-from-start off --clock-control none --section ... \
        python benchmarks/probes/probe_ncu.py CASE

Cases: ``decode_b32_hk8``, ``decode_b1_hk8`` (ours, paged; ``_s512``: 512 keys, ``_seqpages``:
each sequence's pages consecutive), ``sdpa_b32_hk8``, ``sdpa_b1_hk8``
(torch SDPA, contiguous K/V), ``softmax_bf16``, ``argmax_bf16`` (64 x 128256), ``copy_16m``
(a same-size device-to-device copy). Warm-up calls (compiles, workspaces) run before the
profiled one.

GEMM cases (bf16, x (M, K) times a Linear weight W (N, K), b = W.T): ``gemm:M:N:K:CONFIG``,
CONFIG a name of ``gemm_configs.CONFIGS`` (``_kS`` for S splits), ``auto`` (the heuristic) or
``cublas`` (torch.matmul); several joined with ``+`` are profiled in one run, in order.

Attention cases (bf16, (batch, seq, heads, dim) tensors): ``fa:B:H:HK:S:D:CAUSAL:IMPL``, IMPL
``auto`` (the planner's kernel), ``wgmma`` / ``tc`` (forced) or ``cudnn`` / ``flash2`` (SDPA's
backend); several joined with ``+``.

Quantized GEMM cases (bf16 x, an int4 weight of groups of 128): ``quant:M:N:K:PATH``, PATH
``stream``, ``decode`` or ``tc`` (the kernel forced) or ``cublas`` (bf16 torch.matmul on the
dequantized weight); several joined with ``+``.
"""

import os
import sys

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))  # the repository root
sys.path.insert(0, _BENCHMARKS)  # _harness and the bench_*.py modules


def _decode_case(batch, seq_len, nheads_k, sdpa, sequential=False):
    import torch
    from bench_decode import make_inputs, sdpa_baselines, sequential_pages

    from llmspeed_numba.ops import paged_decode as pd

    q, kc, vc, bt, sl, k, v = make_inputs(batch, seq_len, nheads_k, torch.bfloat16, 16)
    if sequential:
        kc, vc, bt = sequential_pages(kc, vc, bt)
    if sdpa:
        return sdpa_baselines(q, k, v)["cudnn" if "cudnn" in sdpa_baselines(q, k, v)
                                       else "default"][0]
    out = torch.empty_like(q)
    return lambda: pd.paged_decode_attention(q, kc, vc, bt, sl, out=out)


def _vocab_case(op):
    import torch

    from llmspeed_numba.ops.argmax import argmax
    from llmspeed_numba.ops.softmax import softmax

    x = torch.randn((64, 128256), device="cuda", dtype=torch.bfloat16)
    if op == "softmax":
        out = torch.empty_like(x)
        return lambda: softmax(x, temperature=0.7, out=out)
    if op == "argmax":
        out = torch.empty((64,), device="cuda", dtype=torch.int64)
        return lambda: argmax(x, out=out)
    y = torch.empty_like(x)
    return lambda: y.copy_(x)


def _gemm_case(spec):
    import torch
    from probe_gemm_small_m import inputs  # the same operands as the sweep's

    from llmspeed_numba import gemm

    _, M, N, K, config = spec.split(":")
    x, w = inputs(int(M), int(N), int(K))
    out = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)
    if config == "cublas":
        return lambda: torch.matmul(x, w.T, out=out)
    config = None if config == "auto" else config
    return lambda: gemm(x, w.T, out=out, config=config)


def _attention_case(spec):
    import torch

    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops.flash_attn import flash_attn

    _, B, H, HK, S, D, causal, impl = spec.split(":")
    B, H, HK, S, D, causal = int(B), int(H), int(HK), int(S), int(D), causal == "1"
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if impl in ("cudnn", "flash2"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash2": SDPBackend.FLASH_ATTENTION}
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa():
            with sdpa_kernel(backend[impl]):
                torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=H != HK)

        return sdpa
    out = torch.empty_like(q)
    knobs = {} if impl == "auto" else {"impl": impl}

    def call():
        with overrides(flash_attn=knobs):
            flash_attn(q, k, v, causal=causal, out=out)

    return call


def _quant_case(spec):
    import torch

    from llmspeed_numba import quant_gemm, quantize_weight
    from llmspeed_numba._overrides import overrides

    _, M, N, K, path = spec.split(":")
    M, N, K = int(M), int(N), int(K)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    qw = quantize_weight(w, "int4", kind="torch")
    if path == "cublas":
        return lambda: torch.matmul(x, w.T, out=out)
    knobs = {"stream": {}, "decode": {"stream_max_m": 0, "decode_max_m": 16},
             "tc": {"stream_max_m": 0, "decode_max_m": 0}}[path]

    def call():
        with overrides(quant_gemm=knobs):
            quant_gemm(x, qw, out=out)

    return call


def _case(name):
    if name.startswith("quant:"):
        fns = [_quant_case(spec) for spec in name.split("+")]
        return lambda: [fn() for fn in fns]
    if name.startswith("fa:"):
        fns = [_attention_case(spec) for spec in name.split("+")]
        return lambda: [fn() for fn in fns]
    if name.startswith("gemm:"):
        fns = [_gemm_case(spec) for spec in name.split("+")]
        return lambda: [fn() for fn in fns]
    return CASES[name]()


CASES = {
    "decode_b32_hk8": lambda: _decode_case(32, 8192, 8, False),
    "decode_b32_hk32": lambda: _decode_case(32, 8192, 32, False),
    "decode_b32_hk8_seqpages": lambda: _decode_case(32, 8192, 8, False, sequential=True),
    "decode_b32_hk8_s512": lambda: _decode_case(32, 512, 8, False),
    "sdpa_b32_hk8_s512": lambda: _decode_case(32, 512, 8, True),
    "decode_b1_hk8": lambda: _decode_case(1, 32768, 8, False),
    "sdpa_b32_hk8": lambda: _decode_case(32, 8192, 8, True),
    "sdpa_b1_hk8": lambda: _decode_case(1, 32768, 8, True),
    "softmax_bf16": lambda: _vocab_case("softmax"),
    "argmax_bf16": lambda: _vocab_case("argmax"),
    "copy_16m": lambda: _vocab_case("copy"),
}


def main():
    import torch

    fn = _case(sys.argv[1])
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
