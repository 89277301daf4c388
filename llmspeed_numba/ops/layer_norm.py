"""LayerNorm, optionally fused with the residual add that precedes it, in one pass over memory.

    mean = mean(x[r, :]);  var = mean((x[r, :] - mean)^2)            (biased, as torch)
    out[r, :] = (x[r, :] - mean) * rsqrt(var + eps) * weight + bias

With ``residual``: ``s = x + residual`` is computed in fp32, rounded to x's dtype, written back
into ``residual`` and normalised (the result is exactly ``layer_norm(residual_after, ...)``).

Layout and dtypes as ``rms_norm``: ``x`` (..., hidden) with a contiguous last dimension and leading
dimensions collapsing into one row stride; ``weight`` and ``bias`` (hidden,) contiguous, both x's
dtype or both float32; ``bias`` may be None; ``out`` x's shape and dtype (``out=x``: in place).

Precision: fp32 throughout; the variance is computed from the row held in registers in a second
reduction (two-pass, no cancellation of ``E[x^2] - E[x]^2``), one rounding at the output.
Kernel: ``rms_norm``'s layout (``_rowwise``); streaming rows (over 32768 halves / 16384 floats)
re-read the row twice (mean, variance, output), mostly from L2.
"""

import functools
import math

import numpy as np
from numba import types

from .. import compile_check
from .._arrays import kernel_buffer, stream_handle
from .._env import cuda
from .._launch import Kernel, array1d, jit
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from . import _rowwise as rw
from .rms_norm import check_eps, prepare_norm

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


def _layer_norm_kernel_fn(x_kind, w_kind, vec, tpr, rpb, cpt, has_residual, has_bias):
    """As ``rms_norm``'s kernel, plus the mean and the bias."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    store = rw.chunk_words_storer(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    pack = rw.chunk_packer(x_kind, vec)
    load_w = rw.chunk_loader(w_kind, vec)
    load_summed = rw.summed_chunk_loader(x_kind, vec, has_residual)
    load_summed1 = rw.summed_chunk_loader(x_kind, 1, has_residual)
    store1 = rw.chunk_words_storer(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    pack1 = rw.chunk_packer(x_kind, 1)
    load_w1 = rw.chunk_loader(w_kind, 1)
    row_sum = rw.row_reducer(tpr, rw.add_f32)
    slots = rw.scratch_slots(tpr, rpb)
    nwords = max(cpt, 1) * wpc
    has_tail = vec > 1

    def layer_norm_kernel(x, residual, weight, bias, out, rows, cols, x_stride, r_stride,
                          o_stride, eps):
        scratch = cuda.shared.array(slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        rwords = cuda.local.array(nwords, np.uint32)
        tword = cuda.local.array(1, np.uint32)  # the tail element: apart from the row's words
        trword = cuda.local.array(1, np.uint32)
        a = cuda.local.array(vec, np.float32)
        b = cuda.local.array(vec, np.float32)
        t = cuda.threadIdx.x % tpr
        row = cuda.blockIdx.x * rpb + cuda.threadIdx.x // tpr
        live = row < rows
        xo = np.int64(row) * x_stride
        ro = np.int64(row) * r_stride
        oo = np.int64(row) * o_stride
        chunks = cols // vec
        src = residual if has_residual else x       # where the (summed) row lives after pass 1
        so = ro if has_residual else xo
        inv_cols = _F1 / np.float32(cols)

        # pass 1: load (and add the residual), sum
        acc = _F0
        if cpt > 0:
            for v in range(cpt):
                c = v * tpr + t
                if live and c < chunks:
                    load(x, xo + c * vec, words, v * wpc)
                    if has_residual:
                        load(residual, ro + c * vec, rwords, v * wpc)
            for v in range(cpt):
                c = v * tpr + t
                if live and c < chunks:
                    unpack(words, v * wpc, a)
                    if has_residual:
                        unpack(rwords, v * wpc, b)
                        for i in range(vec):
                            a[i] = a[i] + b[i]
                        pack(a, words, v * wpc)
                        store(residual, ro + c * vec, words, v * wpc)
                        unpack(words, v * wpc, a)
                    for i in range(vec):
                        acc += a[i]
        else:
            c = t
            while live and c < chunks:
                load_summed(x, xo + c * vec, residual, ro + c * vec, words, rwords, a, b)
                for i in range(vec):
                    acc += a[i]
                c += tpr
        tail = chunks * vec + t
        tail_live = has_tail and live and tail < cols
        if tail_live:
            load_summed1(x, xo + tail, residual, ro + tail, tword, trword, a, b)
            acc += a[0]
        mean = row_sum(acc, scratch) * inv_cols

        # pass 2: variance about the mean
        acc = _F0
        if cpt > 0:
            for v in range(cpt):
                c = v * tpr + t
                if live and c < chunks:
                    unpack(words, v * wpc, a)
                    for i in range(vec):
                        d = a[i] - mean
                        acc += d * d
        else:
            c = t
            while live and c < chunks:
                load(src, so + c * vec, rwords, 0)
                unpack(rwords, 0, a)
                for i in range(vec):
                    d = a[i] - mean
                    acc += d * d
                c += tpr
        if tail_live:
            unpack1(tword, 0, a)
            d = a[0] - mean
            acc += d * d
        var = row_sum(acc, scratch) * inv_cols  # every lane takes part (rows past the end: 0)
        inv = _F1 / math.sqrt(var + eps) if live else _F0

        # pass 3: normalise, scale, shift, store
        if cpt > 0:
            for v in range(cpt):
                c = v * tpr + t
                if live and c < chunks:
                    load_w(weight, c * vec, b, 0)
                    unpack(words, v * wpc, a)
                    for i in range(vec):
                        a[i] = (a[i] - mean) * inv * b[i]
                    if has_bias:
                        load_w(bias, c * vec, b, 0)
                        for i in range(vec):
                            a[i] += b[i]
                    pack(a, words, v * wpc)
                    store(out, oo + c * vec, words, v * wpc)
        else:
            c = t
            while live and c < chunks:
                load(src, so + c * vec, words, 0)
                load_w(weight, c * vec, b, 0)
                unpack(words, 0, a)
                for i in range(vec):
                    a[i] = (a[i] - mean) * inv * b[i]
                if has_bias:
                    load_w(bias, c * vec, b, 0)
                    for i in range(vec):
                        a[i] += b[i]
                pack(a, words, 0)
                store(out, oo + c * vec, words, 0)
                c += tpr
        if tail_live:
            unpack1(tword, 0, a)
            load_w1(weight, tail, b, 0)
            a[0] = (a[0] - mean) * inv * b[0]
            if has_bias:
                load_w1(bias, tail, b, 0)
                a[0] += b[0]
            pack1(a, tword, 0)
            store1(out, oo + tail, tword, 0)

    return layer_norm_kernel


def _signature(x_kind, w_kind):
    xs = array1d(np.float32 if x_kind == rw.KIND_F32 else np.uint16)
    ws = array1d(np.float32 if w_kind == rw.KIND_F32 else np.uint16)
    return (xs, xs, ws, ws, xs, types.int32, types.int32, types.int64, types.int64, types.int64,
            types.float32)


@functools.lru_cache(maxsize=None)
def _layer_norm_kernel(x_kind, w_kind, vec, tpr, rpb, cpt, has_residual, has_bias):
    fn = _layer_norm_kernel_fn(x_kind, w_kind, vec, tpr, rpb, cpt, has_residual, has_bias)
    return Kernel(jit(fn), _signature(x_kind, w_kind), "layer_norm_kernel")


_LAYER_NORM_CALLS = OpCalls("layer_norm")


def layer_norm(x: ArrayLike, weight: ArrayLike, bias: ArrayLike | None, eps: float = 1e-5, *,
               residual: ArrayLike | None = None, out: ArrayLike | None = None,
               stream: StreamLike = None) -> ArrayLike:
    """LayerNorm of the last dimension of ``x``, optionally after adding ``residual`` in place.

    Args:
        x: (..., hidden) fp16 / bf16 / fp32, last dimension contiguous.
        weight: (hidden,) x's dtype or float32.
        bias: (hidden,) weight's dtype, or None.
        eps: added to the variance (a finite number >= 0).
        residual: optional, x's shape and dtype; updated in place to ``x + residual`` (rounded
            to the dtype), whose norm is returned.
        out: optional output, x's shape and dtype (may be ``x``; must not overlap ``residual``).
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``out``: the normalised rows, x's dtype, in x's array kind.

    Raises:
        TypeError: a non-array, an unsupported dtype, dtypes that disagree, eps not a number.
        ValueError: shapes that disagree, a non-contiguous last dimension, hidden == 0,
            eps negative or not finite, ``out`` overlapping ``residual``.
    """
    result = _LAYER_NORM_CALLS.replay((x, weight, bias, residual, out), (eps,), stream)
    if result is MISS:
        result = _LAYER_NORM_CALLS.record(
            _layer_norm_checked, x, weight, bias, eps, residual, out, stream)
    return result


def _layer_norm_checked(x, weight, bias, eps, residual, out, stream):
    """The checked path of ``layer_norm`` (validation, planning, launch)."""
    eps = check_eps(eps)
    p = prepare_norm(x, weight, bias, residual, out)
    if p["rows"] == 0:
        return p["out"]
    tx, tw, tb, tr, to = p["tx"], p["tw"], p["tb"], p["tr"], p["to"]
    tpr, rpb, cpt = p["plan"]
    kernel = _layer_norm_kernel(rw.kind(tx.dtype), rw.kind(tw.dtype), p["vec"], tpr, rpb, cpt,
                                tr is not None, tb is not None)
    xb = kernel_buffer(tx)
    wb = kernel_buffer(tw)
    x_stride, r_stride, o_stride = p["strides"]
    kernel(-(-p["rows"] // rpb), tpr * rpb,
              (xb, xb if tr is None else kernel_buffer(tr), wb,
               wb if tb is None else kernel_buffer(tb), kernel_buffer(to), p["rows"], p["cols"],
               x_stride, r_stride, o_stride, eps), stream_handle(stream, (tx,)))
    return p["out"]


def _register():
    f16, f32 = rw.KIND_F16, rw.KIND_F32
    variants = {
        "layer_norm_f16_residual_4096": (f16, f16, 8, 4096, True, True),
        "layer_norm_f16_stream_131072": (f16, f16, 8, 131072, True, True),
        "layer_norm_f32_residual_16384": (f32, f32, 4, 16384, True, True),
    }
    for name, (xk, wk, vec, hidden, residual, bias) in variants.items():
        plan = rw.row_plan(hidden // vec)

        def build(xk=xk, wk=wk, vec=vec, plan=plan, residual=residual, bias=bias):
            return (_layer_norm_kernel_fn(xk, wk, vec, *plan, residual, bias),
                    _signature(xk, wk))

        compile_check.register(name, build, sass_must_have=("LDG.E.128", "STG.E.128"))


_register()
