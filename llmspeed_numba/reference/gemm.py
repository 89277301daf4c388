"""Float64 reference of ``gemm``, and the plain same-precision version tolerances derive from.

``out = activation(alpha * a @ b + beta * c + bias)``; ``c`` is used only when ``beta != 0`` (BLAS
convention), ``bias`` is a length-N vector added to every row.
"""

import math

import numpy as np

_GELU_C = math.sqrt(2.0 / math.pi)


def activation(x, name):
    """relu / gelu (tanh form) / silu in the precision of ``x``."""
    if name is None:
        return x
    if name == "relu":
        return np.maximum(x, x.dtype.type(0))
    if name == "gelu":
        t = x.dtype.type
        return t(0.5) * x * (t(1) + np.tanh(t(_GELU_C) * (x + t(0.044715) * x * x * x)))
    if name == "silu":
        with np.errstate(over="ignore"):
            return x / (x.dtype.type(1) + np.exp(-x))
    raise ValueError(f"activation: unknown {name!r}")


def _epilogue(acc, dtype, c, alpha, beta, bias, act):
    t = np.dtype(dtype).type
    x = t(alpha) * acc
    if c is not None and beta != 0:
        x = x + t(beta) * np.asarray(c, dtype)
    if bias is not None:
        x = x + np.asarray(bias, dtype)[None, :]
    return activation(x, act)


def gemm_reference(a, b, *, c=None, alpha=1.0, beta=0.0, bias=None, activation=None):
    """float64 ``activation(alpha * a @ b + beta * c + bias)`` of host arrays (any float dtype)."""
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    return _epilogue(a64 @ b64, np.float64, c, alpha, beta, bias, activation)


#: K elements the plain model sums before adding to its running float32 accumulator.
K_STEP = 16


def _round_toward_zero_f32(x64):
    """float64 values rounded to float32 toward zero (numpy's cast rounds to nearest)."""
    r = x64.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x64)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r


def gemm_plain(a, b, *, c=None, alpha=1.0, beta=0.0, bias=None, activation=None,
               out_dtype=np.float32, mma=False):
    """The same computation done simply at the kernel's precision: inputs as stored, float32
    accumulation and epilogue, one rounding to ``out_dtype`` at the end. The float32 sum runs
    over K in order, ``K_STEP`` at a time, as the kernels' accumulators do (one mma k-step):
    a single float32 BLAS matmul sums in blocks and can be several times more accurate than
    any in-order accumulator at K in the thousands.

    ``mma=True`` models a Tensor Core accumulator: each k-step adds its 16 (exact) products to
    the accumulator and the float32 result is truncated (rounded toward zero), not rounded to
    nearest. The truncation is biased, so its error grows with K rather than with sqrt(K), as the
    GPU's results do (benchmarks/NOTES.md, "History moved out of the code")."""
    a32 = np.asarray(a, np.float32)
    b32 = np.asarray(b, np.float32)
    acc = np.zeros((a32.shape[0], b32.shape[1]), np.float32)
    if mma:
        a64 = a32.astype(np.float64)
        b64 = b32.astype(np.float64)
    for k0 in range(0, a32.shape[1], K_STEP):
        if mma:
            step = a64[:, k0:k0 + K_STEP] @ b64[k0:k0 + K_STEP]
            acc = _round_toward_zero_f32(acc.astype(np.float64) + step)
        else:
            acc += a32[:, k0:k0 + K_STEP] @ b32[k0:k0 + K_STEP]
    return _epilogue(acc, np.float32, c, alpha, beta, bias, activation).astype(out_dtype)


#: The activation a gated ``gemm`` activation applies to the gate (``ops/gemm_gated.py``).
GATE_ACTIVATION = {"silu_and_mul": "silu", "gelu_and_mul": "gelu"}


def gated_gemm_reference(a, w_gate, w_up, *, alpha=1.0, bias_gate=None, bias_up=None,
                         activation="silu_and_mul"):
    """float64 ``act(alpha * a @ w_gate + bias_gate) * (alpha * a @ w_up + bias_up)``: the
    gated ``gemm`` with separate (K, I) gate and up weights (not interleaved)."""
    gate = gemm_reference(a, w_gate, alpha=alpha, bias=bias_gate,
                          activation=GATE_ACTIVATION[activation])
    return gate * gemm_reference(a, w_up, alpha=alpha, bias=bias_up)


def gated_gemm_plain(a, w_gate, w_up, *, alpha=1.0, bias_gate=None, bias_up=None,
                     activation="silu_and_mul", out_dtype=np.float32, mma=False):
    """The same in the kernel's precision: each product accumulated as ``gemm_plain`` does,
    bias, activation and the multiply in float32, one rounding to ``out_dtype``."""
    gate = gemm_plain(a, w_gate, alpha=alpha, bias=bias_gate,
                      activation=GATE_ACTIVATION[activation], mma=mma)
    up = gemm_plain(a, w_up, alpha=alpha, bias=bias_up, mma=mma)
    return (gate * up).astype(out_dtype)
