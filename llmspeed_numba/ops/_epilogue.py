"""Element access by storage dtype, and the fused GEMM epilogue, as inline device helpers.

Kernels see fp16 / bf16 arrays as ``uint16`` bits and fp32 as ``float32`` (``_arrays.STORAGE``);
``loader(dtype)`` / ``storer(dtype)`` return the device function that reads / writes one element
of a flat buffer as float32 for the library dtype name ``dtype``. ``epilogue(...)`` builds the
per-element tail every GEMM kernel shares:

    out[m, n] = activation(alpha * acc + beta * c[m, n] + bias[n])     (rounded once to out's dtype)

All choices (dtypes, whether c / bias exist, the activation) are closure constants, so a kernel
without ``c`` has no load of ``c`` at all.
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from ._activations_device import activation


@cuda.jit(device=True, inline="always")
def _load_f16(buf, i):
    return ptx.f16_to_f32(buf[i])


@cuda.jit(device=True, inline="always")
def _load_bf16(buf, i):
    return ptx.bf16_to_f32(buf[i])


@cuda.jit(device=True, inline="always")
def _load_f32(buf, i):
    return np.float32(buf[i])


@cuda.jit(device=True, inline="always")
def _store_f16(buf, i, v):
    buf[i] = ptx.f32_to_f16(v)


@cuda.jit(device=True, inline="always")
def _store_bf16(buf, i, v):
    buf[i] = ptx.f32_to_bf16(v)


@cuda.jit(device=True, inline="always")
def _store_f32(buf, i, v):
    buf[i] = v


_LOADERS = {"float16": _load_f16, "bfloat16": _load_bf16, "float32": _load_f32}
_STORERS = {"float16": _store_f16, "bfloat16": _store_bf16, "float32": _store_f32}


def loader(dtype):
    """Device function ``(buf, i) -> float32`` reading element ``i`` of a ``dtype`` buffer."""
    return _LOADERS[dtype]


def storer(dtype):
    """Device function ``(buf, i, v)`` writing float32 ``v`` rounded to ``dtype``."""
    return _STORERS[dtype]


@functools.lru_cache(maxsize=None)
def epilogue(out_dtype, c_dtype, bias_dtype, act):
    """Device function ``(acc, n, out, out_index, c, c_index, bias, alpha, beta)`` that stores
    ``act(alpha * acc + beta * c[c_index] + bias[n])`` at ``out[out_index]``.

    ``c_dtype`` / ``bias_dtype`` are None when there is no ``c`` (or ``beta == 0``) / no bias;
    the buffers passed for them are then never read.
    """
    store = storer(out_dtype)
    load_c = loader(c_dtype) if c_dtype is not None else _load_f32
    load_bias = loader(bias_dtype) if bias_dtype is not None else _load_f32
    has_c = c_dtype is not None
    has_bias = bias_dtype is not None
    act_fn = activation(act)

    @cuda.jit(device=True, inline="always")
    def apply(acc, n, out, out_index, c, c_index, bias, alpha, beta):
        v = alpha * acc
        if has_c:
            v += beta * load_c(c, c_index)
        if has_bias:
            v += load_bias(bias, n)
        store(out, out_index, act_fn(v))

    return apply
