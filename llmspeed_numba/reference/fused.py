"""Float64 references of the fused inference ops, and the plain same-precision versions their
test tolerances are derived from (``testing.derived_check``).

Each ``<op>(...)`` works on host NumPy arrays (fp16, ml_dtypes bf16, fp32), follows the op's
documented semantics exactly and computes in float64; ``<op>_plain(...)`` is the simple
implementation a user would write in the input precision (float32 arithmetic, rounded where a
torch eager composition rounds). Semantics that involve rounding by definition (the residual sum
written back in the input dtype) are applied in both.
"""

import math

import numpy as np

from .._arrays import dtype_name, numpy_dtype


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _round(x, dtype):
    return np.asarray(x).astype(numpy_dtype(dtype)).astype(np.float64)


def _dtype_name(x):
    return dtype_name(x.dtype, "x")


# ---- norms -------------------------------------------------------------------------------------

def residual_sum(x, residual):
    """What the fused norms write into ``residual``: x + residual added in fp32, rounded once to
    the dtype (bit-exact: the kernels do the same IEEE operations)."""
    dtype = _dtype_name(x)
    s = np.asarray(x).astype(np.float32) + np.asarray(residual).astype(np.float32)
    return s.astype(numpy_dtype(dtype))


def rms_norm(x, weight, eps, residual=None):
    """Float64 ``rms_norm``; returns ``(out, residual_after)`` (``residual_after`` None without
    a residual)."""
    s = x if residual is None else residual_sum(x, residual)
    s64 = _f64(s)
    inv = 1.0 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + eps)
    return s64 * inv * _f64(weight), (None if residual is None else s)


def rms_norm_plain(x, weight, eps, residual=None):
    """The torch eager composition in float32, rounded to x's dtype at the end."""
    s = x if residual is None else residual_sum(x, residual)
    s32 = np.asarray(s).astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(s32 * s32, axis=-1, keepdims=True) + np.float32(eps))
    out = s32 * inv * np.asarray(weight).astype(np.float32)
    return _round(out, _dtype_name(x))


def layer_norm(x, weight, bias, eps, residual=None):
    """Float64 ``layer_norm`` (biased variance, as torch); returns ``(out, residual_after)``."""
    s = x if residual is None else residual_sum(x, residual)
    s64 = _f64(s)
    mean = s64.mean(axis=-1, keepdims=True)
    var = ((s64 - mean) ** 2).mean(axis=-1, keepdims=True)
    out = (s64 - mean) / np.sqrt(var + eps) * _f64(weight)
    if bias is not None:
        out = out + _f64(bias)
    return out, (None if residual is None else s)


def layer_norm_plain(x, weight, bias, eps, residual=None):
    s = x if residual is None else residual_sum(x, residual)
    s32 = np.asarray(s).astype(np.float32)
    mean = s32.mean(axis=-1, keepdims=True, dtype=np.float32)
    var = ((s32 - mean) ** 2).mean(axis=-1, keepdims=True, dtype=np.float32)
    out = (s32 - mean) / np.sqrt(var + np.float32(eps)) * np.asarray(weight).astype(np.float32)
    if bias is not None:
        out = out + np.asarray(bias).astype(np.float32)
    return _round(out, _dtype_name(x))


# ---- activations -------------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu64(v, approximate):
    if approximate == "tanh":
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
    return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))


def _silu64(v):
    with np.errstate(over="ignore"):
        return v / (1.0 + np.exp(-v))


def _act64(v, name):
    return _silu64(v) if name == "silu" else _gelu64(v, name.split("_", 1)[1])


def _act32(v, name):
    """The activation in float32 (what torch computes for fp16 / bf16 / fp32 tensors)."""
    v = np.asarray(v, np.float32)
    with np.errstate(over="ignore"):
        if name == "silu":
            return v / (np.float32(1) + np.exp(-v))
        if name == "gelu_tanh":
            inner = np.float32(math.sqrt(2.0 / math.pi)) * (v + np.float32(0.044715) * v * v * v)
            return np.float32(0.5) * v * (np.float32(1) + np.tanh(inner))
        return (np.float32(0.5) * v * (np.float32(1) + _erf(v / math.sqrt(2.0)).astype(
            np.float32))).astype(np.float32)


def gated(x, name):
    """Float64 ``act(x[..., :d]) * x[..., d:]``; ``name`` "silu", "gelu_none", "gelu_tanh"."""
    x64 = _f64(x)
    d = x64.shape[-1] // 2
    return _act64(x64[..., :d], name) * x64[..., d:]


def gated_plain(x, name):
    """torch eager: ``F.<act>(gate) * up``, each op rounded to x's dtype."""
    dtype = _dtype_name(x)
    x32 = np.asarray(x).astype(np.float32)
    d = x32.shape[-1] // 2
    act = _round(_act32(x32[..., :d], name), dtype).astype(np.float32)
    return _round(act * x32[..., d:], dtype)


def activation(x, name):
    """Float64 ``act(x)`` elementwise."""
    return _act64(_f64(x), name)


def activation_plain(x, name):
    return _round(_act32(np.asarray(x).astype(np.float32), name), _dtype_name(x))


# ---- rotary embedding --------------------------------------------------------------------------

def _rotate(x, cos, sin, style, rotary_dim):
    """Rotate the first ``rotary_dim`` elements of each head of ``x`` (tokens, heads, headdim)
    by per-token ``cos`` / ``sin`` (tokens, rotary_dim / 2), in x's float type."""
    out = x.copy()
    half = rotary_dim // 2
    c = cos[:, None, :]
    s = sin[:, None, :]
    if style == "neox":
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rotary_dim] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * c - x2 * s
        out[..., 1:rotary_dim:2] = x2 * c + x1 * s
    return out


def rotary_cos_sin(positions, rotary_dim, base=10000.0, cos_sin_cache=None):
    """Float64 (cos, sin), each (tokens, rotary_dim / 2)."""
    half = rotary_dim // 2
    pos = np.asarray(positions).astype(np.int64)
    if cos_sin_cache is not None:
        cache = _f64(cos_sin_cache)
        return cache[pos, :half], cache[pos, half:]
    inv = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angle = pos[:, None].astype(np.float64) * inv[None, :]
    return np.cos(angle), np.sin(angle)


def rotary(x, positions, rotary_dim, style, base=10000.0, cos_sin_cache=None):
    """Float64 rotary embedding of one of q / k (tokens, heads, headdim)."""
    cos, sin = rotary_cos_sin(positions, rotary_dim, base, cos_sin_cache)
    return _rotate(_f64(x), cos, sin, style, rotary_dim)


def rotary_plain(x, positions, rotary_dim, style, base=10000.0, cos_sin_cache=None):
    """fp32 rotary as torch builds it: ``inv_freq = 1 / base ** (arange(0, d, 2) / d)`` and
    ``angle = positions * inv_freq`` in fp32, cos / sin in fp32, rounded to x's dtype."""
    half = rotary_dim // 2
    pos = np.asarray(positions).astype(np.int64)
    if cos_sin_cache is not None:
        cache = np.asarray(cos_sin_cache).astype(np.float32)
        cos, sin = cache[pos, :half], cache[pos, half:]
    else:
        exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
        inv = np.float32(1.0) / (np.float32(base) ** exponent)
        angle = pos[:, None].astype(np.float32) * inv[None, :].astype(np.float32)
        cos, sin = np.cos(angle), np.sin(angle)
    out = _rotate(np.asarray(x).astype(np.float32), cos.astype(np.float32),
                  sin.astype(np.float32), style, rotary_dim)
    return _round(out, _dtype_name(x))


def rotary_cache(max_position, rotary_dim, base=10000.0, dtype="float32"):
    """A vLLM-layout ``cos_sin_cache`` (max_position, rotary_dim): cos | sin, from float64."""
    pos = np.arange(max_position)
    cos, sin = rotary_cos_sin(pos, rotary_dim, base)
    return np.concatenate([cos, sin], axis=1).astype(numpy_dtype(dtype))


# ---- softmax and argmax ------------------------------------------------------------------------

def softmax(x, temperature=1.0):
    """Float64 softmax over the last dimension (NaN rows where torch has them)."""
    z = _f64(x) / temperature
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(z, axis=-1, keepdims=True)
        e = np.exp(z - m)
        return e / np.sum(e, axis=-1, keepdims=True)


def softmax_plain(x, temperature=1.0, dtype=None):
    """torch eager in fp32: ``(x.float() / T).softmax(-1).to(dtype)``."""
    z = np.asarray(x).astype(np.float32) / np.float32(temperature)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(z, axis=-1, keepdims=True)
        e = np.exp(z - m)
        p = e / np.sum(e, axis=-1, keepdims=True, dtype=np.float32)
    return _round(p, dtype or _dtype_name(x))


def argmax(x):
    """Index of the first maximum of each row; NaN counts as the maximum (as torch)."""
    return np.argmax(_f64(x), axis=-1).astype(np.int64)
