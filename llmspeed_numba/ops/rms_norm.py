"""RMSNorm, optionally fused with the residual add that precedes it, in one pass over memory.

    out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight

With ``residual`` (vLLM's ``fused_add_rms_norm``): ``s = x + residual`` is computed in fp32,
rounded to x's dtype, written back into ``residual`` (the pre-norm residual stream of the next
layer) and normalised, so the result is exactly ``rms_norm(residual_after, weight)``.

Layout: ``x`` (..., hidden), last dimension contiguous, leading dimensions collapsing into one row
stride (contiguous arrays, slices of rows); ``weight`` (hidden,) contiguous, x's dtype or float32;
``residual`` x's shape and dtype; ``out`` x's shape and dtype (a new C-contiguous array in x's
kind unless given; ``out=x`` normalises in place; ``out`` must not overlap ``residual``).

Precision: fp16 / bf16 / fp32 inputs, fp32 arithmetic throughout (sum of squares, scale, weight),
one rounding at the output.

Kernel: one row per ``threads_per_row`` threads (``_rowwise.row_plan``): the row is loaded once
into registers with 16-byte loads where every array is 16-byte aligned (scalar loads otherwise,
a scalar tail for ``hidden % 8``), reduced with warp shuffles and shared memory, scaled and stored.
Rows longer than the register budget (over 32768 halves / 16384 floats) stream: the output pass
re-reads the row (from L2). Register-held rows are scheduled one of two ways (``_schedule``):

- ``"loads_first"``: every load of a pass before any store of it (x and residual, then the weight),
  so each pass waits for memory once: the updated residual is stored in the output pass, and the
  adds and the sum of squares run on every chunk slot (dead slots hold zeros), since a load used
  only under a condition, or followed by a possibly aliasing store, is issued in series. Always
  taken with the residual (81 -> 97% of copy at hidden 14336).
- ``"interleaved"``: each weight chunk is loaded beside its output store,
  registers as compiled (50). Taken without the residual on rows of ``INTERLEAVED_MIN_THREADS``
  threads (512-thread blocks, two resident a SM either way), where it measured faster.
"""

import functools
import math

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import no_overlap, one_of_dtypes, output, same_dtype, shape, tensor
from .._env import cuda
from .._launch import Kernel, array1d, jit, programmatic_launch
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from . import _rowwise as rw

FLOAT_DTYPES = ("float16", "bfloat16", "float32")

SCHEDULES = ("loads_first", "interleaved")
#: Rows of at least this many threads (over 1024 chunks: halves over 8192 elements, fp32 over
#: 4096) take "interleaved" without the residual: faster there, slower on narrower rows
#: (benchmarks/NOTES.md, "Fused ops"; probe_norms.py times both in one run).
INTERLEAVED_MIN_THREADS = 512
#: ``schedule``: the schedule of register-held rows without the residual, None (picked by row
#: width, ``_schedule``) or a name from ``SCHEDULES`` (forced: benchmarks/probes/probe_norms.py
#: A/Bs them).
TUNING = Knobs("rms_norm", choices={"schedule": (None, *SCHEDULES)}, schedule=None)

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


def _schedule(tpr, cpt, has_residual):
    """True for the "interleaved" schedule (see the module docstring)."""
    if cpt == 0 or has_residual:
        return False
    choice = TUNING.schedule
    if choice is None:
        return tpr >= INTERLEAVED_MIN_THREADS
    return choice == "interleaved"


def _rms_norm_kernel_fn(x_kind, w_kind, vec, tpr, rpb, cpt, has_residual, interleaved=False,
                        trigger=False):
    """Kernel for storage kinds ``x_kind`` (x, residual, out) / ``w_kind`` (weight), chunks of
    ``vec`` elements, ``tpr`` threads per row, ``rpb`` rows per block, ``cpt`` chunks per thread
    held in registers (0: stream), with or without the residual add, register-held rows
    scheduled "interleaved" or "loads_first". ``trigger``: each block first releases the next
    programmatic kernel's launch (``griddep_launch_dependents``), which then waits for this
    grid's completion itself."""
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
    # the weight's chunks loaded ahead as words, unless they are twice as wide as the row's
    # (fp32 weights of a half-precision row: twice the registers; loaded beside each store)
    prefetch_w = cpt > 0 and not interleaved and not (
        vec > 1 and w_kind == rw.KIND_F32 and x_kind != rw.KIND_F32)
    load_ww = rw.chunk_words_loader(w_kind, vec)
    unpack_w = rw.chunk_unpacker(w_kind, vec)
    nwwords = nwords if prefetch_w else 1
    has_tail = vec > 1

    def rms_norm_kernel(x, residual, weight, out, rows, cols, x_stride, r_stride, o_stride, eps):
        if trigger:
            ptx.griddep_launch_dependents()
        scratch = cuda.shared.array(slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)     # the row (or one chunk when streaming)
        rwords = cuda.local.array(nwords, np.uint32)    # the residual chunks
        wwords = cuda.local.array(nwwords, np.uint32)    # the weight chunks
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
        ss = _F0

        if cpt > 0:
            # every load first (independent, all in flight), then the adds; the residual is
            # stored after the reduction: a store to it here let the compiler sink the next
            # chunk's residual load behind it (one DRAM round trip a chunk, in series)
            for v in range(cpt):
                c = v * tpr + t
                if live and c < chunks:
                    load(x, xo + c * vec, words, v * wpc)
                    if has_residual:
                        load(residual, ro + c * vec, rwords, v * wpc)
                elif not interleaved:  # zeros for the unconditional adds and squares below
                    for i in range(wpc):
                        words[v * wpc + i] = np.uint32(0)
                        rwords[v * wpc + i] = np.uint32(0)
            for v in range(cpt):
                # loads_first: no condition here, since the compiler merges one with the load's
                # and sinks the use of the first chunk before the other loads (two DRAM round
                # trips a row: NOTES, "Fused ops")
                if interleaved and not (live and v * tpr + t < chunks):
                    continue
                unpack(words, v * wpc, a)
                if has_residual:
                    unpack(rwords, v * wpc, b)
                    for i in range(vec):
                        a[i] = a[i] + b[i]
                    pack(a, words, v * wpc)         # s rounded to x's dtype, kept in registers
                    unpack(words, v * wpc, a)
                for i in range(vec):
                    ss += a[i] * a[i]
        else:
            c = t
            while live and c < chunks:
                load_summed(x, xo + c * vec, residual, ro + c * vec, words, rwords, a, b)
                for i in range(vec):
                    ss += a[i] * a[i]
                c += tpr

        # scalar tail: element chunks * vec + t of the row, for t < cols % vec
        tail = chunks * vec + t
        tail_live = has_tail and live and tail < cols
        if tail_live:
            load_summed1(x, xo + tail, residual, ro + tail, tword, trword, a, b)
            ss += a[0] * a[0]

        total = row_sum(ss, scratch)  # every lane takes part; rows past the end sum to zero
        inv = _F1 / math.sqrt(total / np.float32(cols) + eps) if live else _F0

        if cpt > 0:
            # every weight chunk before the first store: loaded beside each output store, its
            # (L2) latency came in series, once a chunk (the store might alias it)
            if prefetch_w:
                for v in range(cpt):
                    c = v * tpr + t
                    if live and c < chunks:
                        load_ww(weight, c * vec, wwords, v * wpc)
            for v in range(cpt):
                c = v * tpr + t
                if live and c < chunks:
                    if has_residual:
                        store(residual, ro + c * vec, words, v * wpc)
                    if prefetch_w:
                        unpack_w(wwords, v * wpc, b)
                    else:
                        load_w(weight, c * vec, b, 0)
                    unpack(words, v * wpc, a)
                    for i in range(vec):
                        a[i] = a[i] * inv * b[i]
                    pack(a, words, v * wpc)
                    store(out, oo + c * vec, words, v * wpc)
        else:
            c = t
            while live and c < chunks:
                if has_residual:
                    load(residual, ro + c * vec, words, 0)
                else:
                    load(x, xo + c * vec, words, 0)
                load_w(weight, c * vec, b, 0)
                unpack(words, 0, a)
                for i in range(vec):
                    a[i] = a[i] * inv * b[i]
                pack(a, words, 0)
                store(out, oo + c * vec, words, 0)
                c += tpr
        if tail_live:
            unpack1(tword, 0, a)
            load_w1(weight, tail, b, 0)
            a[0] = a[0] * inv * b[0]
            pack1(a, tword, 0)
            store1(out, oo + tail, tword, 0)

    return rms_norm_kernel


def _signature(x_kind, w_kind):
    xs = array1d(np.float32 if x_kind == rw.KIND_F32 else np.uint16)
    ws = array1d(np.float32 if w_kind == rw.KIND_F32 else np.uint16)
    return (xs, xs, ws, xs, types.int32, types.int32, types.int64, types.int64, types.int64,
            types.float32)


def _options(tpr, rpb, cpt, vec, interleaved=False):
    """"loads_first": at most 64 registers (1024 threads an SM) when a pass holds at most 32
    words of data a thread (half-precision rows up to 16384, fp32 up to 8192): with every load of
    a pass in flight the kernel takes 66-72 unbounded, and 512-thread blocks would run one an SM.
    Wider rows, and "interleaved" (49-50 registers), keep what the compiler picks."""
    threads = tpr * rpb
    if cpt == 0 or interleaved or 2 * cpt * rw.words_per_chunk(vec) > 32:
        return {}
    return {"launch_bounds": (threads, max(1, 1024 // threads))}


@functools.lru_cache(maxsize=None)
def _rms_norm_kernel(x_kind, w_kind, vec, tpr, rpb, cpt, has_residual, interleaved,
                     trigger=False):
    fn = _rms_norm_kernel_fn(x_kind, w_kind, vec, tpr, rpb, cpt, has_residual, interleaved,
                             trigger)
    return Kernel(jit(fn, **_options(tpr, rpb, cpt, vec, interleaved)),
                  _signature(x_kind, w_kind), "rms_norm_kernel")


def check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps}")
    return float(eps)


def prepare_norm(x, weight, bias, residual, out):
    """Shared checks of rms_norm / layer_norm; returns the tensors, views and the plan."""
    tx = tensor(x, "x", dtypes=FLOAT_DTYPES)
    tw = tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES)
    tb = None if bias is None else tensor(bias, "bias", ndim=1, dtypes=FLOAT_DTYPES)
    tr = None if residual is None else tensor(residual, "residual", dtypes=FLOAT_DTYPES)
    rows, cols, x_stride = rw.rows_view("x", tx)
    if cols == 0:
        raise ValueError(f"x: expected a non-empty last dimension, got shape {tx.shape}")
    shape("weight", tw, (cols,), "to match x's last dimension")
    if tb is not None:
        shape("bias", tb, (cols,), "to match x's last dimension")
    if tr is not None:
        shape("residual", tr, tx.shape, "to match x")
    same_dtype("x", tx, residual=tr)
    one_of_dtypes("weight", tw, (tx.dtype, "float32"), "x's")
    if tb is not None and tb.dtype != tw.dtype:
        raise TypeError(f"bias: expected dtype {tw.dtype} to match weight, got {tb.dtype}")
    for nm, t in (("weight", tw), ("bias", tb)):
        if t is not None and cols > 1 and t.strides[0] != 1:
            raise ValueError(f"{nm}: expected a contiguous vector, got strides {t.strides}")
    r_stride = x_stride if tr is None else rw.rows_view("residual", tr)[2]
    to = output("out", out, tx.shape, tx.dtype, tx)
    if to is not None:  # both are written: the norm to out, x + residual to residual
        no_overlap("out", to, "residual", tr)
    if to is None:
        out = empty(tx, tx.shape, tx.dtype)
        to = tensor(out, "out")
    o_stride = rw.rows_view("out", to)[2]
    vec = rw.vector_width(tx.dtype)
    aligned = (rw.vector_aligned(tx, x_stride, vec) and rw.vector_aligned(to, o_stride, vec)
               and (tr is None or rw.vector_aligned(tr, r_stride, vec))
               and tw.ptr % 16 == 0 and (tb is None or tb.ptr % 16 == 0))
    if not aligned:
        vec = 1
    tpr, rpb, cpt = rw.row_plan(cols // vec)
    return dict(tx=tx, tw=tw, tb=tb, tr=tr, to=to, out=out, rows=rows, cols=cols,
                strides=(x_stride, r_stride, o_stride), vec=vec, plan=(tpr, rpb, cpt))


_RMS_NORM_CALLS = OpCalls("rms_norm")


def rms_norm(x: ArrayLike, weight: ArrayLike, eps: float = 1e-6, *,
             residual: ArrayLike | None = None, out: ArrayLike | None = None,
             stream: StreamLike = None) -> ArrayLike:
    """RMSNorm of the last dimension of ``x``, optionally after adding ``residual`` in place.

    Args:
        x: (..., hidden) fp16 / bf16 / fp32, last dimension contiguous.
        weight: (hidden,) x's dtype or float32.
        eps: added to the mean square (a finite number >= 0).
        residual: optional, x's shape and dtype; updated in place to ``x + residual`` (rounded
            to the dtype), whose norm is returned (vLLM's fused add + RMSNorm).
        out: optional output, x's shape and dtype (may be ``x``; must not overlap ``residual``).
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``out``: the normalised rows, x's dtype, in x's array kind.

    Raises:
        TypeError: a non-array, an unsupported dtype, dtypes that disagree, eps not a number.
        ValueError: shapes that disagree, a non-contiguous last dimension, hidden == 0,
            eps negative or not finite, ``out`` overlapping ``residual``.
    """
    result = _RMS_NORM_CALLS.replay((x, weight, residual, out), (eps,), stream)
    if result is MISS:
        result = _RMS_NORM_CALLS.record(_rms_norm_checked, x, weight, eps, residual, out, stream)
    return result


def _rms_norm_checked(x, weight, eps, residual, out, stream):
    """The checked path of ``rms_norm`` (validation, planning, launch)."""
    eps = check_eps(eps)
    p = prepare_norm(x, weight, None, residual, out)
    if p["rows"] == 0:
        return p["out"]
    tx, tw, tr, to = p["tx"], p["tw"], p["tr"], p["to"]
    tpr, rpb, cpt = p["plan"]
    kernel = _rms_norm_kernel(rw.kind(tx.dtype), rw.kind(tw.dtype), p["vec"], tpr, rpb, cpt,
                              tr is not None, _schedule(tpr, cpt, tr is not None),
                              programmatic_launch())
    xb = kernel_buffer(tx)
    rb = xb if tr is None else kernel_buffer(tr)
    x_stride, r_stride, o_stride = p["strides"]
    kernel(-(-p["rows"] // rpb), tpr * rpb,
              (xb, rb, kernel_buffer(tw), kernel_buffer(to), p["rows"], p["cols"], x_stride,
               r_stride, o_stride, eps), stream_handle(stream, (tx,)))
    return p["out"]


# ---- compile-only checks (sm_90a SASS): the benchmark shapes' plans -------------------------

def _register():
    f16, bf16, f32 = rw.KIND_F16, rw.KIND_BF16, rw.KIND_F32
    variants = {
        # name: (x_kind, w_kind, vec, hidden, residual)
        "rms_norm_f16_4096": (f16, f16, 8, 4096, False),
        "rms_norm_bf16_14336": (bf16, bf16, 8, 14336, False),  # "interleaved" by default
        "rms_norm_bf16_residual_14336": (bf16, bf16, 8, 14336, True),
        "rms_norm_f16_stream_131072": (f16, f16, 8, 131072, True),
        "rms_norm_f32_residual_16384": (f32, f32, 4, 16384, True),
    }
    for name, (xk, wk, vec, hidden, residual) in variants.items():
        plan = rw.row_plan(hidden // vec)

        def build(xk=xk, wk=wk, vec=vec, plan=plan, residual=residual):
            interleaved = _schedule(plan[0], plan[2], residual)
            return (_rms_norm_kernel_fn(xk, wk, vec, *plan, residual, interleaved),
                    _signature(xk, wk), _options(*plan, vec, interleaved))

        compile_check.register(name, build, sass_must_have=("LDG.E.128", "STG.E.128"))
    compile_check.register(
        "rms_norm_f16_scalar_4099",
        lambda: (_rms_norm_kernel_fn(f16, f16, 1, *rw.row_plan(4099), True),
                 _signature(f16, f16), _options(*rw.row_plan(4099), 1)))
    compile_check.register(  # half-precision rows with fp32 weights: two loads a weight chunk
        "rms_norm_bf16_f32_weight_4096",
        lambda: (_rms_norm_kernel_fn(bf16, f32, 8, *rw.row_plan(512), False),
                 _signature(bf16, f32), _options(*rw.row_plan(512), 8)),
        sass_must_have=("LDG.E.128", "STG.E.128"))


_register()
