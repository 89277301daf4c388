"""Gated and plain activations of transformer MLPs, each one pass over memory.

    silu_and_mul(x)[..., j] = silu(x[..., j]) * x[..., d + j]        x (..., 2d) -> (..., d)
    gelu_and_mul(x)[..., j] = gelu(x[..., j]) * x[..., d + j]        (GeGLU)
    gelu(x) = x * Phi(x)                                             same shape

``silu(v) = v / (1 + exp(-v))``; ``gelu`` is exact (``approximate="none"``, ``0.5 v (1 +
erf(v / sqrt 2))``, torch's default) or the tanh form (``approximate="tanh"``). The gated layout is
vLLM's (``SiluAndMul``, ``GeluAndMul``): the gate in the first half of the last dimension, the up
projection in the second.

Layout: ``x`` (..., n) with a contiguous last dimension, leading dimensions collapsing into one row
stride; ``out`` (new, C-contiguous, in x's kind unless given) has x's dtype. fp16 / bf16 / fp32,
computed in fp32 and rounded once.

Kernel: a 2-D grid of (column chunks, rows); each thread loads ``UNROLL`` 16-byte chunks (of each
half) before computing, so several loads are in flight per thread. 16-byte access needs x and out
16-byte aligned with row strides (and, gated, ``d``) multiples of 8 halves / 4 floats; otherwise a
scalar kernel (and, plain ``gelu``, a scalar tail for ``n % 8``).
"""

import functools
import math

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import choice, output, tensor
from .._env import cuda
from .._launch import Kernel, array1d, jit, programmatic_launch
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from . import _rowwise as rw
from ._activations_device import gelu_erf, gelu_tanh, gelu_tanh_fast, silu, silu_fast

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
#: Chunks per thread loaded before any is computed (loads in flight per thread, per input).
UNROLL = 2
#: Threads per block.
BLOCK_THREADS = 256
#: Rows of the grid's y dimension (a hardware limit); larger row counts loop.
_MAX_GRID_Y = 65535
#: What the launcher reads, overridable (scope ``activations`` of ``_overrides.overrides``:
#: tests take smaller blocks, and a smaller grid to run the kernel's row loop).
TUNING = Knobs("activations", block_threads=BLOCK_THREADS, max_grid_y=_MAX_GRID_Y)

# ---- fast activations for half-precision data ---------------------------------------------------
# fp16 / bf16 traffic is 2 bytes an element, so at HBM speed the SM has about 30 instructions an
# element to spend; libdevice's expf + IEEE division (silu) or erff (about 35 instructions) would
# make the op compute-bound. The SFU forms (ex2, rcp: ``_activations_device.silu_fast``,
# ``gelu_tanh_fast`` and the erf form below) keep the relative error below 3e-5, under a tenth of
# an fp16 ulp (4.9e-4) and a hundredth of a bf16 ulp. fp32 data (twice the bytes per element)
# uses the libdevice forms of ``_activations_device``.

_F1 = np.float32(1.0)
# gelu_erf(v) = v * Phi(v); h = Phi(-|v|) = 2^(-v^2 log2(e) / 2 + R(t)), t = min(|v| / sqrt 2, 10),
# R(t) = log2(erfc(t)) + t^2 log2(e) - 1 fitted by a degree-10 polynomial on Chebyshev nodes of
# [0, 10] (max relative error of h 2.6e-5 wherever h > 1e-38, float32 evaluation included).
_ERF_R = tuple(np.float32(c) for c in (
    -0.9999832510948181, -1.6284656524658203, 0.5274261236190796, -0.15560665726661682,
    0.0366821251809597, -0.006563009228557348, 0.0008579632267355919, -7.861951598897576e-05,
    4.753155280923238e-06, -1.6957426396402298e-07, 2.6964228627690545e-09))
_ERF_R0, _ERF_R1, _ERF_R2, _ERF_R3, _ERF_R4, _ERF_R5 = _ERF_R[:6]
_ERF_R6, _ERF_R7, _ERF_R8, _ERF_R9, _ERF_R10 = _ERF_R[6:]
_INV_SQRT2 = np.float32(1.0 / math.sqrt(2.0))
_HALF_NEG_LOG2E = np.float32(-0.5 * math.log2(math.e))
_T_MAX = np.float32(10.0)


@cuda.jit(device=True, inline="always")
def _gelu_erf_fast(v):
    t = min(abs(v) * _INV_SQRT2, _T_MAX)
    r = _ERF_R10
    r = r * t + _ERF_R9
    r = r * t + _ERF_R8
    r = r * t + _ERF_R7
    r = r * t + _ERF_R6
    r = r * t + _ERF_R5
    r = r * t + _ERF_R4
    r = r * t + _ERF_R3
    r = r * t + _ERF_R2
    r = r * t + _ERF_R1
    r = r * t + _ERF_R0
    h = ptx.ex2_approx(v * v * _HALF_NEG_LOG2E + r)
    return v * (h if v < 0 else _F1 - h)


_ACTS = {"silu": silu, "gelu_none": gelu_erf, "gelu_tanh": gelu_tanh}
_FAST_ACTS = {"silu": silu_fast, "gelu_none": _gelu_erf_fast, "gelu_tanh": gelu_tanh_fast}


def _activation_kernel_fn(k, vec, act_name, gated, unroll, trigger=False):
    """``out = act(x[:, :d]) * x[:, d:]`` (gated) or ``act(x)``, chunks of ``vec`` elements.
    ``trigger``: each block first releases the next programmatic kernel's launch (as
    ``rms_norm``'s)."""
    act = (_ACTS if k == rw.KIND_F32 else _FAST_ACTS)[act_name]
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(k, vec)
    store = rw.chunk_words_storer(k, vec)
    unpack = rw.chunk_unpacker(k, vec)
    pack = rw.chunk_packer(k, vec)
    load1 = rw.chunk_words_loader(k, 1)
    store1 = rw.chunk_words_storer(k, 1)
    unpack1 = rw.chunk_unpacker(k, 1)
    pack1 = rw.chunk_packer(k, 1)
    has_tail = vec > 1 and not gated
    nwords = unroll * wpc

    def activation_kernel(x, out, rows, d, x_stride, o_stride):
        if trigger:
            ptx.griddep_launch_dependents()
        # d: output columns (gated: half of x's); chunks of the output row
        ga = cuda.local.array(nwords, np.uint32)
        gb = cuda.local.array(nwords, np.uint32)
        a = cuda.local.array(vec, np.float32)
        b = cuda.local.array(vec, np.float32)
        chunks = d // vec
        c0 = cuda.blockIdx.x * cuda.blockDim.x * unroll + cuda.threadIdx.x
        row = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        while row < rows:
            xo = np.int64(row) * x_stride
            oo = np.int64(row) * o_stride
            for u in range(unroll):
                c = c0 + u * cuda.blockDim.x
                if c < chunks:
                    load(x, xo + c * vec, ga, u * wpc)
                    if gated:
                        load(x, xo + d + c * vec, gb, u * wpc)
            for u in range(unroll):
                c = c0 + u * cuda.blockDim.x
                if c < chunks:
                    unpack(ga, u * wpc, a)
                    if gated:
                        unpack(gb, u * wpc, b)
                        for i in range(vec):
                            a[i] = act(a[i]) * b[i]
                    else:
                        for i in range(vec):
                            a[i] = act(a[i])
                    pack(a, ga, u * wpc)
                    store(out, oo + c * vec, ga, u * wpc)
            if has_tail and cuda.blockIdx.x == 0:
                e = chunks * vec + cuda.threadIdx.x
                if e < d:
                    load1(x, xo + e, ga, 0)
                    unpack1(ga, 0, a)
                    a[0] = act(a[0])
                    pack1(a, ga, 0)
                    store1(out, oo + e, ga, 0)
            row += cuda.gridDim.y * cuda.blockDim.y

    return activation_kernel


def _signature(k):
    buf = array1d(np.float32 if k == rw.KIND_F32 else np.uint16)
    return (buf, buf, types.int32, types.int32, types.int64, types.int64)


@functools.lru_cache(maxsize=None)
def _activation_kernel(k, vec, act_name, gated, unroll, trigger=False):
    fn = _activation_kernel_fn(k, vec, act_name, gated, unroll, trigger)
    return Kernel(jit(fn), _signature(k), f"{act_name}{'_and_mul' if gated else ''}_kernel")


def _launch(x, out, stream, act_name, gated):
    tx = tensor(x, "x", dtypes=FLOAT_DTYPES)
    rows, cols, x_stride = rw.rows_view("x", tx)
    if gated and cols % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up halves), got shape "
                         f"{tx.shape}")
    d = cols // 2 if gated else cols
    out_shape = tx.shape[:-1] + (d,)
    to = output("out", out, out_shape, tx.dtype, tx)
    if to is None:
        out = empty(tx, out_shape, tx.dtype)
        to = tensor(out, "out")
    if rows == 0 or d == 0:
        return out
    _, _, o_stride = rw.rows_view("out", to)
    vec = rw.vector_width(tx.dtype)
    if not (rw.vector_aligned(tx, x_stride, vec) and rw.vector_aligned(to, o_stride, vec)
            and (not gated or d % vec == 0)):
        vec = 1
    chunks = d // vec
    unroll = UNROLL
    block_threads = TUNING.block_threads
    tx_threads = min(block_threads, rw.pow2_ceil(max(1, -(-chunks // unroll))))
    if vec > 1 and not gated:
        tx_threads = max(tx_threads, vec)  # the scalar tail needs up to vec - 1 threads
    ty_threads = max(1, block_threads // tx_threads)
    grid = (max(1, -(-chunks // (tx_threads * unroll))),
            min(TUNING.max_grid_y, -(-rows // ty_threads)))
    kernel = _activation_kernel(rw.kind(tx.dtype), vec, act_name, gated, unroll,
                                programmatic_launch())
    kernel(grid, (tx_threads, ty_threads),
              (kernel_buffer(tx), kernel_buffer(to), rows, d, x_stride, o_stride),
              stream_handle(stream, (tx,)))
    return out


def _check_approximate(approximate):
    choice("approximate", approximate, ("none", "tanh"))
    return f"gelu_{approximate}"


_SILU_AND_MUL_CALLS = OpCalls("silu_and_mul")


def silu_and_mul(x: ArrayLike, *, out: ArrayLike | None = None,
                 stream: StreamLike = None) -> ArrayLike:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` (..., 2d): returns (..., d) in x's dtype and
    kind (or ``out``).

    Raises:
        TypeError: a non-array or an unsupported dtype (fp16, bf16, fp32 only), ``out`` of
            another dtype.
        ValueError: an odd last dimension, a non-contiguous last dimension, ``out`` of the wrong
            shape.
    """
    result = _SILU_AND_MUL_CALLS.replay((x, out), (), stream)
    if result is MISS:
        result = _SILU_AND_MUL_CALLS.record(_silu_and_mul_checked, x, out, stream)
    return result


def _silu_and_mul_checked(x, out, stream):
    """The checked path of ``silu_and_mul`` (validation, planning, launch)."""
    return _launch(x, out, stream, "silu", True)


_GELU_AND_MUL_CALLS = OpCalls("gelu_and_mul")


def gelu_and_mul(x: ArrayLike, *, approximate: str = "none", out: ArrayLike | None = None,
                 stream: StreamLike = None) -> ArrayLike:
    """``gelu(x[..., :d]) * x[..., d:]`` for ``x`` (..., 2d) (GeGLU); ``approximate`` is
    ``"none"`` (erf, exact) or ``"tanh"``. Returns (..., d); errors as ``silu_and_mul``."""
    result = _GELU_AND_MUL_CALLS.replay((x, out), (approximate,), stream)
    if result is MISS:
        result = _GELU_AND_MUL_CALLS.record(_gelu_and_mul_checked, x, approximate, out, stream)
    return result


def _gelu_and_mul_checked(x, approximate, out, stream):
    """The checked path of ``gelu_and_mul`` (validation, planning, launch)."""
    return _launch(x, out, stream, _check_approximate(approximate), True)


_GELU_CALLS = OpCalls("gelu")


def gelu(x: ArrayLike, *, approximate: str = "none", out: ArrayLike | None = None,
         stream: StreamLike = None) -> ArrayLike:
    """GELU of every element of ``x`` (..., n): exact (``approximate="none"``) or the tanh form.
    Returns x's shape, dtype and kind (or ``out``; ``out=x`` works in place)."""
    result = _GELU_CALLS.replay((x, out), (approximate,), stream)
    if result is MISS:
        result = _GELU_CALLS.record(_gelu_checked, x, approximate, out, stream)
    return result


def _gelu_checked(x, approximate, out, stream):
    """The checked path of ``gelu`` (validation, planning, launch)."""
    return _launch(x, out, stream, _check_approximate(approximate), False)


def _register():
    for name, (k, vec, act, gated) in {
        "silu_and_mul_bf16": (rw.KIND_BF16, 8, "silu", True),
        "gelu_f32": (rw.KIND_F32, 4, "gelu_none", False),
        "gelu_erf_bf16": (rw.KIND_BF16, 8, "gelu_none", False),
    }.items():
        compile_check.register(
            name, lambda k=k, vec=vec, act=act, gated=gated: (
                _activation_kernel_fn(k, vec, act, gated, UNROLL), _signature(k)),
            sass_must_have=("LDG.E.128", "STG.E.128"))


_register()
