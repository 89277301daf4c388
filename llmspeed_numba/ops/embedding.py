"""Row gather: ``out[i, :] = weight[ids[i], :]`` (token embedding lookup).

Layout: ``ids`` (n,) int32 / int64; ``weight`` (rows, hidden) fp16 / bf16 / fp32 with a contiguous
last dimension (any row stride); ``out`` (n, hidden), weight's dtype. An id outside
``[0, rows)`` gives a row of zeros (as vLLM's vocabulary-parallel embedding masks ids it does not
own), so no input makes the kernel read outside ``weight``.

The same op picks the last token of each sequence from a packed batch before the LM head.

Kernel: a 2-D grid of (column chunks, rows); each thread copies 16-byte chunks as raw words (no
conversion), scalar elements when the rows are not 16-byte aligned.
"""

import functools

import numpy as np
from numba import types

from .. import compile_check
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import output, tensor
from .._env import cuda
from .._launch import Kernel, array1d, jit
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from . import _rowwise as rw

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
ID_DTYPES = ("int32", "int64")
#: Threads per block.
BLOCK_THREADS = 128
#: Rows of the grid's y dimension (a hardware limit); larger row counts loop.
_MAX_GRID_Y = 65535


def _embedding_kernel_fn(k, vec):
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(k, vec)
    store = rw.chunk_words_storer(k, vec)

    def embedding_kernel(ids, weight, out, n, rows, cols, w_stride, o_stride):
        words = cuda.local.array(wpc, np.uint32)
        chunks = cols // vec
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        i = cuda.blockIdx.y
        while i < n:
            row = np.int64(ids[i])
            oo = np.int64(i) * o_stride + c * vec
            if c < chunks:
                if 0 <= row < rows:
                    load(weight, row * w_stride + c * vec, words, 0)
                else:
                    for w in range(wpc):
                        words[w] = np.uint32(0)
                store(out, oo, words, 0)
            i += cuda.gridDim.y

    return embedding_kernel


def _signature(k, id_dtype):
    buf = array1d(np.float32 if k == rw.KIND_F32 else np.uint16)
    return (array1d(np.dtype(id_dtype)), buf, buf, types.int32, types.int64, types.int32,
            types.int64, types.int64)


@functools.lru_cache(maxsize=None)
def _embedding_kernel(k, vec, id_dtype):
    return Kernel(jit(_embedding_kernel_fn(k, vec)), _signature(k, id_dtype), "embedding_kernel")


_EMBEDDING_CALLS = OpCalls("embedding")


def embedding(ids: ArrayLike, weight: ArrayLike, *, out: ArrayLike | None = None,
              stream: StreamLike = None) -> ArrayLike:
    """``weight[ids]``: rows of ``weight`` (rows, hidden) picked by ``ids`` (n,).

    Args:
        ids: (n,) int32 or int64; an id outside ``[0, rows)`` gives a row of zeros.
        weight: (rows, hidden) fp16 / bf16 / fp32, last dimension contiguous.
        out: optional (n, hidden) of weight's dtype (rows of any stride, last dimension
            contiguous).
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``out``: (n, hidden) in weight's dtype and array kind.

    Raises:
        TypeError: a non-array, ids not int32 / int64, weight not fp16 / bf16 / fp32, ``out``
            of another dtype.
        ValueError: wrong ranks, a non-contiguous last dimension or ids, ``out`` of the wrong
            shape.
    """
    result = _EMBEDDING_CALLS.replay((ids, weight, out), (), stream)
    if result is MISS:
        result = _EMBEDDING_CALLS.record(_embedding_checked, ids, weight, out, stream)
    return result


def _embedding_checked(ids, weight, out, stream):
    """The checked path of ``embedding`` (validation, planning, launch)."""
    tw = tensor(weight, "weight", ndim=2, dtypes=FLOAT_DTYPES)
    ti = tensor(ids, "ids", ndim=1, dtypes=ID_DTYPES)
    rows, cols = tw.shape
    if rows and cols > 1 and tw.strides[1] != 1:
        raise ValueError(f"weight: expected the last dimension to be contiguous (stride 1), got "
                         f"strides {tw.strides}")
    if ti.shape[0] > 1 and ti.strides[0] != 1:
        raise ValueError(f"ids: expected a contiguous array, got strides {ti.strides}")
    n = ti.shape[0]
    to = output("out", out, (n, cols), tw.dtype, tw)
    if to is None:
        out = empty(tw, (n, cols), tw.dtype)
        to = tensor(out, "out")
    if n == 0 or cols == 0:
        return out
    _, _, o_stride = rw.rows_view("out", to)
    w_stride = tw.strides[0] if rows > 1 else cols
    vec = rw.vector_width(tw.dtype)
    if not (rw.vector_aligned(tw, w_stride, vec) and rw.vector_aligned(to, o_stride, vec)
            and cols % vec == 0):
        vec = 1
    chunks = cols // vec
    threads = min(BLOCK_THREADS, rw.pow2_ceil(chunks))
    grid = (-(-chunks // threads), min(_MAX_GRID_Y, n))
    _embedding_kernel(rw.kind(tw.dtype), vec, ti.dtype)(
        grid, threads,
        (kernel_buffer(ti), kernel_buffer(tw), kernel_buffer(to), n, rows, cols, w_stride,
         o_stride),
        stream_handle(stream, (tw,)))
    return out


compile_check.register(
    "embedding_bf16", lambda: (_embedding_kernel_fn(rw.KIND_BF16, 8),
                               _signature(rw.KIND_BF16, "int64")),
    sass_must_have=("LDG.E.128", "STG.E.128"))
