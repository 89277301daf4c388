"""Demo of FlashAttention forward: causal GQA, a sliding window and a varlen batch, each against
the float64 reference with the derived tolerance (twice the error of plain same-precision
attention, plus half an ulp at 1)."""

import numpy as np

from ._case import DemoCase, time_call
from ..ops.flash_attn import flash_attn, flash_attn_varlen
from ..reference.attention import attention, attention_varlen
from ..testing import f64, random_array, to_device

_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _error_and_tolerance(got, q, k, v, dtype, reference, **options):
    expected, _ = reference(f64(q), f64(k), f64(v), **options)
    plain, _ = reference(f64(q), f64(k), f64(v), dtype=dtype, **options)
    err = float(np.abs(f64(got) - expected).max())
    tol = 2 * float(np.abs(plain - expected).max()) + _EPS[dtype] / 2 * max(
        float(np.abs(expected).max()), 1.0)
    return err, tol


def cases(on_gpu):
    kind = "torch" if on_gpu else "numba"
    rng = np.random.default_rng(0)

    def batched(batch, seqlen, nheads, nheads_k, headdim, dtype, **options):
        def run():
            q = random_array((batch, seqlen, nheads, headdim), dtype, rng)
            k = random_array((batch, seqlen, nheads_k, headdim), dtype, rng)
            v = random_array((batch, seqlen, nheads_k, headdim), dtype, rng)
            qd, kd, vd = (to_device(x, kind) for x in (q, k, v))
            got = flash_attn(qd, kd, vd, **options)
            err, tol = _error_and_tolerance(got, q, k, v, dtype, attention, **options)
            return err, tol, time_call(lambda: flash_attn(qd, kd, vd, **options), on_gpu)

        return run

    def varlen(lengths, nheads, headdim, dtype, **options):
        def run():
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            total = int(cu[-1])
            q, k, v = (random_array((total, nheads, headdim), dtype, rng) for _ in range(3))
            args = [to_device(x, kind) for x in (q, k, v, cu, cu)]
            longest = int(max(lengths))
            got = flash_attn_varlen(*args, longest, longest, **options)
            err, tol = _error_and_tolerance(
                got, q, k, v, dtype, lambda *a, **o: attention_varlen(*a, cu, cu, **o), **options)
            return err, tol, time_call(lambda: flash_attn_varlen(*args, longest, longest,
                                                                 **options), on_gpu)

        return run

    if on_gpu:
        specs = [
            ("flash_attn causal GQA", "B2 S1024 H16/4 D128 fp16",
             batched(2, 1024, 16, 4, 128, "float16", causal=True)),
            ("flash_attn window", "B2 S1024 H8 D64 bf16 w(256,0)",
             batched(2, 1024, 8, 8, 64, "bfloat16", window_size=(256, 0))),
            ("flash_attn_varlen causal", "lens 100/1000/517 H8 D128 fp16",
             varlen([100, 1000, 517], 8, 128, "float16", causal=True)),
        ]
    else:
        specs = [
            ("flash_attn causal GQA", "B1 S19 H4/2 D16 fp16",
             batched(1, 19, 4, 2, 16, "float16", causal=True)),
            ("flash_attn window", "B1 S23 H2 D24 bf16 w(5,0)",
             batched(1, 23, 2, 2, 24, "bfloat16", window_size=(5, 0))),
            ("flash_attn_varlen causal", "lens 3/17/9 H2 D16 fp16",
             varlen([3, 17, 9], 2, 16, "float16", causal=True)),
        ]
    return [DemoCase(op, shape, run) for op, shape, run in specs]
