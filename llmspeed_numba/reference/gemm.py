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


def gemm_plain(a, b, *, c=None, alpha=1.0, beta=0.0, bias=None, activation=None,
               out_dtype=np.float32):
    """The same computation done simply at the kernel's precision: inputs as stored, float32
    accumulation and epilogue, one rounding to ``out_dtype`` at the end."""
    acc = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return _epilogue(acc, np.float32, c, alpha, beta, bias, activation).astype(out_dtype)
