"""Demo of the fused inference ops: norms, rotary embedding, activations, softmax, argmax.

Each case runs the op on random data, compares it with its float64 reference and reports the
error against a tolerance derived as in the tests: twice the error of the plain same-precision
composition (torch eager's arithmetic), plus 1e-6 of the output's scale.
"""

import numpy as np

from ._case import DemoCase, time_call
from ..ops.activations import gelu, gelu_and_mul, silu_and_mul
from ..ops.layer_norm import layer_norm
from ..ops.rms_norm import rms_norm
from ..ops.rotary import rotary_embedding
from ..ops.argmax import argmax
from ..ops.softmax import softmax
from ..reference import fused as ref
from ..testing import f64, random_array, to_device


def _derived(got, expected, plain):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    err = float(np.abs(got - expected).max())
    tol = 2.0 * float(np.abs(np.asarray(plain, np.float64) - expected).max()) + 1e-6 * max(
        float(np.abs(expected).max()), 1.0)
    return err, tol


def cases(on_gpu):
    rng = np.random.default_rng(0)
    kind = "torch" if on_gpu else "numpy"
    tokens, hidden = (8192, 4096) if on_gpu else (2, 40)
    heads, kv_heads, headdim = (32, 8, 128) if on_gpu else (2, 1, 16)
    rows, vocab = (64, 128256) if on_gpu else (2, 300)
    dtype = "bfloat16"

    def dev(host):
        return to_device(np.array(host, copy=True), kind)

    def norm(op):
        x_h = random_array((tokens, hidden), dtype, rng)
        r_h = random_array((tokens, hidden), dtype, rng)
        w_h = random_array((hidden,), dtype, rng)
        b_h = random_array((hidden,), dtype, rng)
        x, w, b, r = dev(x_h), dev(w_h), dev(b_h), dev(r_h)
        if op == "rms_norm":
            got = rms_norm(x, w, residual=r)
            expected, _ = ref.rms_norm(x_h, w_h, 1e-6, r_h)
            plain = ref.rms_norm_plain(x_h, w_h, 1e-6, r_h)
            err = _derived(f64(got), expected, plain)
            seconds = time_call(lambda: rms_norm(x, w, residual=r), on_gpu)
        else:
            got = layer_norm(x, w, b, residual=r)
            expected, _ = ref.layer_norm(x_h, w_h, b_h, 1e-5, r_h)
            plain = ref.layer_norm_plain(x_h, w_h, b_h, 1e-5, r_h)
            err = _derived(f64(got), expected, plain)
            seconds = time_call(lambda: layer_norm(x, w, b, residual=r), on_gpu)
        return err + (seconds,)

    def rotary():
        q_h = random_array((tokens, heads, headdim), dtype, rng)
        k_h = random_array((tokens, kv_heads, headdim), dtype, rng)
        pos_h = rng.integers(0, 8192, size=tokens).astype(np.int64)
        q, k, pos = dev(q_h), dev(k_h), dev(pos_h)
        rotary_embedding(q, k, pos)
        errs, tols = [], []
        for got, x_h in ((q, q_h), (k, k_h)):
            e, t = _derived(f64(got), ref.rotary(x_h, pos_h, headdim, "neox"),
                            ref.rotary_plain(x_h, pos_h, headdim, "neox"))
            errs.append(e)
            tols.append(t)
        seconds = time_call(lambda: rotary_embedding(q, k, pos), on_gpu)
        return max(errs), min(tols), seconds

    def gated(name):
        x_h = random_array((tokens, 2 * hidden), dtype, rng, scale=2.0)
        x = dev(x_h)
        fn = silu_and_mul if name == "silu" else (lambda v: gelu_and_mul(v, approximate="tanh"))
        got = fn(x)
        err, tol = _derived(f64(got), ref.gated(x_h, name), ref.gated_plain(x_h, name))
        return err, tol, time_call(lambda: fn(x), on_gpu)

    def gelu_case():
        x_h = random_array((tokens, hidden), dtype, rng, scale=2.0)
        x = dev(x_h)
        got = gelu(x)
        err, tol = _derived(f64(got), ref.activation(x_h, "gelu_none"),
                            ref.activation_plain(x_h, "gelu_none"))
        return err, tol, time_call(lambda: gelu(x), on_gpu)

    def softmax_case():
        x_h = random_array((rows, vocab), "float32", rng, scale=4.0)
        x = dev(x_h)
        got = softmax(x, temperature=0.8)
        err, tol = _derived(f64(got), ref.softmax(x_h, 0.8), ref.softmax_plain(x_h, 0.8))
        return err, tol, time_call(lambda: softmax(x, temperature=0.8), on_gpu)

    def argmax_case():
        x_h = random_array((rows, vocab), dtype, rng)
        x = dev(x_h)
        mismatches = float(np.sum(f64(argmax(x)) != ref.argmax(x_h)))
        return mismatches, 0.0, time_call(lambda: argmax(x), on_gpu)

    nshape = f"({tokens}, {hidden}) {dtype}"
    return [
        DemoCase("rms_norm + residual", nshape, lambda: norm("rms_norm")),
        DemoCase("layer_norm + residual", nshape, lambda: norm("layer_norm")),
        DemoCase("rotary_embedding neox", f"q ({tokens}, {heads}, {headdim}) k {kv_heads} heads",
                 rotary),
        DemoCase("silu_and_mul", f"({tokens}, {2 * hidden}) {dtype}", lambda: gated("silu")),
        DemoCase("gelu_and_mul tanh", f"({tokens}, {2 * hidden}) {dtype}",
                 lambda: gated("gelu_tanh")),
        DemoCase("gelu", nshape, gelu_case),
        DemoCase("softmax T=0.8", f"({rows}, {vocab}) float32", softmax_case),
        DemoCase("argmax (mismatches)", f"({rows}, {vocab}) {dtype}", argmax_case),
    ]
