"""Greedy argmax over the vocabulary: the index of each row's largest logit.

    argmax(x)[r] = the lowest j with x[r, j] = max x[r, :]

``x`` (..., vocab) fp16 / bf16 / fp32 with a contiguous last dimension (leading dimensions
collapsing into one row stride), vocab up to 2^31 - 1; the result is int64, shape x.shape[:-1].

Special values, as torch: a NaN anywhere in a row is its argmax (NaN compares above everything,
lowest NaN index); a row of -inf only gives 0; ``-0.0`` and ``0.0`` tie (lowest index wins).

One kernel (``_rowwise`` layout; few long rows split over blocks as ``_split_rows`` plans). Each
thread scans its chunks cheaply (chunk max and a NaN probe, the exact index search only for a
chunk that beats the thread's best), the block reduces 64-bit keys (ordered value bits above the
complemented index), and with split rows each block merges its key into the row's with
``atomicMax``; the last block of a row (an atomic ticket) writes the index and resets key and
ticket (workspace kept per device and stream, so CUDA graphs can capture the kernel).
"""

import functools

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import output, tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit, sm_count
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from .._workspace import workspace
from . import _rowwise as rw
from . import _split_rows as rs
from ._last_block import draw_ticket

#: Split rows: blocks per SM at most. The scan is issue-bound, so a third block an SM only adds
#: merge work (measurements: benchmarks/NOTES.md, "argmax split count").
MAX_BLOCKS_PER_SM = 2

_F0 = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_U32_MAX = np.uint32(0xFFFFFFFF)
_U64_LOW = np.uint64(0xFFFFFFFF)
_U64_32 = np.uint64(32)


# ---- device helpers ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _argmax_scan(n):
    """Device function ``scan(bv, bi, a, i0) -> (bv, bi)`` over ``a[0:n]`` at indices i0.. in
    increasing order (a tie keeps the earlier index)."""

    @cuda.jit(device=True, inline="always")
    def scan(bv, bi, a, i0):
        for i in range(n):
            v = a[i]
            if bi < 0 or v > bv or (v != v and bv == bv):
                bv = v
                bi = i0 + i
        return bv, bi

    return scan


@cuda.jit(device=True, inline="always")
def _argmax_key(bv, bi):
    """A (value, index) candidate as a 64-bit key, (high, low) words, whose unsigned order is
    argmax's: order-preserving value bits (NaN highest, -0 == 0) above the complemented index
    (the lower index wins a tie). No candidate (index -1) is 0, below every real key."""
    if bi < 0:
        return np.uint32(0), np.uint32(0)
    bits = ptx.f32_bits(bv)
    if bv != bv:
        bits = np.uint32(0x7FFFFFFF)
    elif bv == _F0:
        bits = np.uint32(0)
    if bits & np.uint32(0x80000000):
        ordered = bits ^ _U32_MAX
    else:
        ordered = bits | np.uint32(0x80000000)
    return ordered, _U32_MAX - np.uint32(bi)


@cuda.jit(device=True, inline="always")
def _key_max(h1, l1, h2, l2):
    """The larger of two 64-bit keys ``(high, low)``, each word carried as the bits of a float32
    so that ``rw.row_pair_reducer`` can reduce them: they are only moved (shuffles, shared
    memory, selects), never computed with, so every bit pattern (NaN ones too) survives."""
    a = ptx.f32_bits(h1)
    b = ptx.f32_bits(h2)
    # one return: with a return in each branch NVVM leaves the 16-warp merge loop rolled
    if b > a or (b == a and ptx.f32_bits(l2) > ptx.f32_bits(l1)):
        h1 = h2
        l1 = l2
    return h1, l1


@functools.lru_cache(maxsize=None)
def _argmax_chunk(n):
    """Device function ``chunk(bv, bi, a, i0) -> (bv, bi)``: ``_argmax_scan`` of ``a[0:n]``,
    run only when the chunk can change the answer: its max (NaN-blind) beats
    ``bv``, or its sum is NaN (a NaN or infinities of both signs: scanned exactly) while ``bv``
    is not NaN, or there is no candidate yet. Three instructions an element on the common path
    instead of the exact scan's nine."""
    scan = _argmax_scan(n)

    @cuda.jit(device=True, inline="always")
    def chunk(bv, bi, a, i0):
        cm = a[0]
        probe = a[0]
        for i in range(1, n):
            cm = max(cm, a[i])
            probe += a[i]
        if bi < 0 or cm > bv or (probe != probe and bv == bv):
            bv, bi = scan(bv, bi, a, i0)
        return bv, bi

    return chunk


def _argmax_kernel_fn(x_kind, vec, tpr, rpb, unroll, split):
    """Grid (row blocks, splits): each span's best (value, index) as a 64-bit key; with
    ``split`` merged across spans with ``atomicMax`` and a ticket counter."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    chunk = _argmax_chunk(vec)
    scan1 = _argmax_scan(1)
    reduce = rw.row_pair_reducer(tpr, _key_max, False)
    pair_slots = 2 * rw.scratch_slots(tpr, rpb)
    has_tail = vec > 1
    nwords = unroll * wpc

    def argmax_kernel(x, out, keys, tickets, rows, cols, x_stride, span):
        scratch = cuda.shared.array(pair_slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        a = cuda.local.array(vec, np.float32)
        w1 = cuda.local.array(1, np.uint32)
        t = cuda.threadIdx.x % tpr
        row = cuda.blockIdx.x * rpb + cuda.threadIdx.x // tpr
        live = row < rows
        s = cuda.blockIdx.y
        splits = cuda.gridDim.y
        xo = np.int64(row) * x_stride
        chunks = cols // vec
        c_begin = s * span
        c_end = min(c_begin + span, chunks)
        bv = _NEG_INF
        bi = np.int32(-1)
        c = c_begin + t
        while live and c < c_end:
            for u in range(unroll):
                if c + u * tpr < c_end:
                    load(x, xo + (c + u * tpr) * vec, words, u * wpc)
            for u in range(unroll):
                if c + u * tpr < c_end:
                    unpack(words, u * wpc, a)
                    bv, bi = chunk(bv, bi, a, np.int32((c + u * tpr) * vec))
            c += unroll * tpr
        tail = chunks * vec + t
        if has_tail and live and s == splits - 1 and tail < cols:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            bv, bi = scan1(bv, bi, a, np.int32(tail))
        hi, lo = _argmax_key(bv, bi)
        hf, lf = reduce(ptx.f32_from_bits(hi), ptx.f32_from_bits(lo), scratch)
        hi, lo = ptx.f32_bits(hf), ptx.f32_bits(lf)
        if not live or t != 0:
            return
        if not split:
            out[row] = np.int64(_U32_MAX - lo)
            return
        cuda.atomic.max(keys, row, (np.uint64(hi) << _U64_32) | np.uint64(lo))
        cuda.threadfence()  # release: the key is merged before the ticket is drawn
        if draw_ticket(tickets, row, np.uint32(splits - 1)):
            best = cuda.atomic.exch(keys, row, np.uint64(0))
            out[row] = np.int64(_U32_MAX - np.uint32(best & _U64_LOW))

    return argmax_kernel


def _argmax_signature(x_kind):
    return (rs.buffer_type(x_kind), array1d(np.int64), array1d(np.uint64), array1d(np.uint32),
            types.int32, types.int32, types.int64, types.int32)


@functools.lru_cache(maxsize=None)
def _argmax_kernel(x_kind, vec, tpr, rpb, unroll, split):
    return Kernel(jit(_argmax_kernel_fn(x_kind, vec, tpr, rpb, unroll, split)),
                  _argmax_signature(x_kind), "argmax_kernel")


# ---- plan and launch ---------------------------------------------------------------------------

def _argmax_plan(rows, chunks, x_kind, vec):
    """``(kernel, splits, threads_per_row, rows_per_block)``: rows split over blocks when there
    are too few to fill the GPU, the grid then one wave (what fits at once)."""
    threads = rs.TUNING.split_threads
    splits = rs.aim(rows, chunks, threads)
    if splits > 1:
        kernel = _argmax_kernel(x_kind, vec, threads, 1, rs.UNROLL, True)
        # no second, partly filled wave
        splits = max(1, min(splits, rs.resident_blocks(kernel, threads) // rows))
        if not SIMULATOR:  # (the simulator's one "SM" would never split)
            splits = max(1, min(splits, MAX_BLOCKS_PER_SM * sm_count() // rows))
        if splits > 1:
            return kernel, splits, threads, 1
    tpr, rpb, _ = rw.row_plan(chunks)
    return _argmax_kernel(x_kind, vec, tpr, rpb, rs.UNROLL, False), 1, tpr, rpb


_ARGMAX_CALLS = OpCalls("argmax")


def argmax(x: ArrayLike, *, out: ArrayLike | None = None,
           stream: StreamLike = None) -> ArrayLike:
    """Index of the largest element of each row of ``x`` (..., vocab): greedy sampling.

    Ties go to the lowest index; NaN counts as the largest value (as torch.argmax).

    Returns:
        ``out``: int64, shape ``x.shape[:-1]``, in x's array kind.

    Raises:
        TypeError: non-arrays, unsupported dtypes, ``out`` not int64.
        ValueError: an empty or non-contiguous last dimension, ``out`` of the wrong shape.
    """
    result = _ARGMAX_CALLS.replay((x, out), (), stream)
    if result is MISS:
        result = _ARGMAX_CALLS.record(_argmax_checked, x, out, stream)
    return result


def _argmax_checked(x, out, stream):
    """The checked path of ``argmax`` (validation, planning, launch)."""
    tx, rows, cols, x_stride = rs.prepare(x)
    out_shape = tx.shape[:-1]
    to = output("out", out, out_shape, "int64", tx)
    if to is None:
        out = empty(tx, out_shape, "int64")
        to = tensor(out, "out")
    if rows == 0:
        return out
    if to.ndim and not to.is_contiguous():
        raise ValueError(f"out: expected a contiguous array, got strides {to.strides}")
    vec = rw.vector_width(tx.dtype)
    if not rw.vector_aligned(tx, 0 if rows == 1 else x_stride, vec):
        vec = 1
    chunks = cols // vec
    handle = stream_handle(stream, (tx,))
    kernel, splits, tpr, rpb = _argmax_plan(rows, chunks, rw.kind(tx.dtype), vec)
    span = -(-chunks // splits)
    keys = workspace(tx, handle, "argmax_keys", rows, np.uint64, own_in_graph="graph")
    tickets = workspace(tx, handle, "argmax_tickets", rows, np.uint32, own_in_graph="graph")
    kernel((-(-rows // rpb), splits), tpr * rpb,
           (kernel_buffer(tx), kernel_buffer(to), keys, tickets, rows, cols, x_stride, span),
           handle)
    return out


def _register():
    bf16, f32 = rw.KIND_BF16, rw.KIND_F32
    threads = rs.SPLIT_THREADS
    checks = {
        "argmax_split_f32": lambda: (
            _argmax_kernel_fn(f32, 4, threads, 1, rs.UNROLL, True), _argmax_signature(f32)),
        "argmax_bf16_rows": lambda: (
            _argmax_kernel_fn(bf16, 8, 128, 1, rs.UNROLL, False), _argmax_signature(bf16)),
    }
    for name, build in checks.items():
        compile_check.register(name, build, sass_must_have=("LDG.E.128",))


_register()
