"""Softmax over the vocabulary and greedy argmax: the sampling end of an LLM.

    softmax(x, temperature)[r, j] = exp((x[r, j] - max_j x[r, :]) / T) / sum_j exp(...)
    argmax(x)[r] = the lowest j with x[r, j] = max x[r, :]

``x`` (..., vocab) fp16 / bf16 / fp32 with a contiguous last dimension (leading dimensions
collapsing into one row stride), vocab up to 2^31 - 1. Accumulation in fp32 (the max, the sum of
exponentials, each probability); the softmax output has x's dtype or float32 (``dtype=``,
``out=``).

Special values, as torch: a NaN anywhere in a row makes that row's softmax NaN and is its argmax
(NaN compares above everything, lowest NaN index); a row of -inf only has a NaN softmax (0 / 0 -
torch's answer too: a fully masked row is an upstream bug worth seeing) and argmax 0; +inf in a
row makes its softmax NaN. ``-0.0`` and ``0.0`` tie (lowest index wins).

Kernels (``_rowwise`` layout):
- rows that fit in registers (<= 32768 halves / 16384 floats) with enough rows to fill the GPU:
  one fused kernel, the row read once into registers, max and sum reduced, probabilities written;
- otherwise each row is split over ``splits`` blocks (few rows of a long vocabulary, e.g. 64 x
  128256: ``splits * rows`` about 4 blocks per SM): a stats kernel computes each span's online
  (max, sum of exp), a write kernel merges the spans' partials and writes its span (the second
  read of x mostly hits L2). argmax needs one kernel: each span's (value, index) is merged into a
  per-row 64-bit key with ``atomicMax`` and the last span of a row (an atomic ticket) writes the
  index and resets the key and ticket (workspace kept per device and stream, so calls on one
  stream reuse it and CUDA graphs can capture the kernel).
"""

import functools
import math

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import Buffer, empty, kernel_buffer, stream_handle
from .._checks import output, tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit, sm_count
from . import _rowwise as rw

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
#: Threads per row when rows are split over several blocks.
SPLIT_THREADS = 512
#: 16-byte chunks each thread loads before using any (loads in flight per thread).
UNROLL = 4
#: Blocks aimed for per SM when rows are split (enough to hide the reduction tail).
BLOCKS_PER_SM = 4
#: A span of a split row is at least this many chunks per thread (amortises the partials).
MIN_CHUNKS_PER_THREAD = 4

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_LOG2E = math.log2(math.e)
_U32_MAX = np.uint32(0xFFFFFFFF)


# ---- device helpers ----------------------------------------------------------------------------
# Online softmax state (m, z): the running max m of x and z = sum 2^((x - m) * scale), kept in x's
# units so every exponent is (x - m) * scale, as exact as the plain fp32 exp(x - max).

_NAN = np.float32(np.nan)


@cuda.jit(device=True, inline="always")
def _merge(m1, z1, m2, z2, scale):
    """Merge two online-softmax states."""
    m = rw.max_f32(m1, m2)
    if m == _NEG_INF:
        return m, _F0
    return m, z1 * ptx.ex2_approx((m1 - m) * scale) + z2 * ptx.ex2_approx((m2 - m) * scale)


@cuda.jit(device=True, inline="always")
def _rescale(m, z, row_m, scale):
    """A thread's sum z (about its max m) re-expressed about the row's max."""
    if m == _NEG_INF:
        return z  # 0, or NaN already
    return z * ptx.ex2_approx((m - row_m) * scale)


@functools.lru_cache(maxsize=None)
def _online_update(n):
    """Device function ``update(m, z, a, scale) -> (m, z)`` folding ``a[0:n]`` into the state
    (a NaN poisons z, so the row comes out NaN whatever the other threads saw)."""

    @cuda.jit(device=True, inline="always")
    def update(m, z, a, scale):
        cm = a[0]
        for i in range(1, n):
            cm = rw.max_f32(cm, a[i])
        if cm != cm:
            z = _NAN
        elif cm > m:
            z = z * ptx.ex2_approx((m - cm) * scale)
            m = cm
        if m != _NEG_INF:
            for i in range(n):
                z += ptx.ex2_approx((a[i] - m) * scale)
        return m, z

    return update


@cuda.jit(device=True, inline="always")
def _argmax_merge(v1, i1, v2, i2):
    """The better of two (value, index) candidates: NaN above all, then larger, then lower
    index; index -1 means no candidate."""
    if i2 < 0:
        return v1, i1
    if i1 < 0:
        return v2, i2
    n1 = v1 != v1
    n2 = v2 != v2
    if n1 or n2:
        if n1 and n2:
            return (v1, i1) if i1 < i2 else (v2, i2)
        return (v1, i1) if n1 else (v2, i2)
    if v2 > v1 or (v2 == v1 and i2 < i1):
        return v2, i2
    return v1, i1


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


# ---- softmax kernels ---------------------------------------------------------------------------

def _softmax_fused_kernel_fn(x_kind, o_kind, vec, tpr, rpb, cpt):
    """One pass: the row in registers (``cpt`` chunks a thread), max, sum, probabilities."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    store = rw.chunk_storer(o_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    store1 = rw.chunk_storer(o_kind, 1)
    row_max = rw.row_reducer(tpr, rw.max_f32)
    row_sum = rw.row_reducer(tpr, rw.add_f32)
    slots = rw.scratch_slots(tpr, rpb)
    has_tail = vec > 1
    nwords = cpt * wpc

    def softmax_fused_kernel(x, out, rows, cols, x_stride, o_stride, scale):
        scratch = cuda.shared.array(slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        w1 = cuda.local.array(1, np.uint32)
        a = cuda.local.array(vec, np.float32)
        t = cuda.threadIdx.x % tpr
        row = cuda.blockIdx.x * rpb + cuda.threadIdx.x // tpr
        live = row < rows
        xo = np.int64(row) * x_stride
        oo = np.int64(row) * o_stride
        chunks = cols // vec
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                load(x, xo + c * vec, words, v * wpc)
        tail = chunks * vec + t
        tail_live = has_tail and live and tail < cols
        tv = _NEG_INF
        if tail_live:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            tv = a[0]
        m = tv
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                unpack(words, v * wpc, a)
                for i in range(vec):
                    m = rw.max_f32(m, a[i])
        m = row_max(m, scratch)
        z = _F0
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                unpack(words, v * wpc, a)
                for i in range(vec):
                    z += ptx.ex2_approx((a[i] - m) * scale)
        if tail_live:
            z += ptx.ex2_approx((tv - m) * scale)
        inv = _F1 / row_sum(z, scratch)
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                unpack(words, v * wpc, a)
                for i in range(vec):
                    a[i] = ptx.ex2_approx((a[i] - m) * scale) * inv
                store(out, oo + c * vec, a, 0)
        if tail_live:
            a[0] = ptx.ex2_approx((tv - m) * scale) * inv
            store1(out, oo + tail, a, 0)

    return softmax_fused_kernel


def _softmax_split_kernel_fn(x_kind, o_kind, vec, tpr, unroll, write):
    """Split rows, grid (rows, splits): ``write=False`` computes each span's online state into
    ``pm`` / ``pl``; ``write=True`` merges the row's states and writes the span."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    store = rw.chunk_storer(o_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    store1 = rw.chunk_storer(o_kind, 1)
    update = _online_update(vec)
    update1 = _online_update(1)
    row_max = rw.row_reducer(tpr, rw.max_f32)
    row_sum = rw.row_reducer(tpr, rw.add_f32)
    slots = rw.scratch_slots(tpr, 1)
    has_tail = vec > 1
    nwords = unroll * wpc

    def softmax_split_kernel(x, out, pm, pl, cols, x_stride, o_stride, span, scale):
        scratch = cuda.shared.array(slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        a = cuda.local.array(vec, np.float32)
        w1 = cuda.local.array(1, np.uint32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        s = cuda.blockIdx.y
        splits = cuda.gridDim.y
        xo = np.int64(row) * x_stride
        oo = np.int64(row) * o_stride
        chunks = cols // vec
        c_begin = s * span
        c_end = min(c_begin + span, chunks)
        tail = chunks * vec + t
        tail_live = has_tail and s == splits - 1 and tail < cols
        if not write:
            m = _NEG_INF
            z = _F0
            c = c_begin + t
            while c < c_end:
                for u in range(unroll):
                    if c + u * tpr < c_end:
                        load(x, xo + (c + u * tpr) * vec, words, u * wpc)
                for u in range(unroll):
                    if c + u * tpr < c_end:
                        unpack(words, u * wpc, a)
                        m, z = update(m, z, a, scale)
                c += unroll * tpr
            if tail_live:
                load1(x, xo + tail, w1, 0)
                unpack1(w1, 0, a)
                m, z = update1(m, z, a, scale)
            row_m = row_max(m, scratch)
            z = row_sum(_rescale(m, z, row_m, scale), scratch)
            if t == 0:
                pm[row * splits + s] = row_m
                pl[row * splits + s] = z
        else:
            m = _NEG_INF
            z = _F0
            for j in range(splits):
                m, z = _merge(m, z, pm[row * splits + j], pl[row * splits + j], scale)
            inv = _F1 / z
            c = c_begin + t
            while c < c_end:
                for u in range(unroll):
                    if c + u * tpr < c_end:
                        load(x, xo + (c + u * tpr) * vec, words, u * wpc)
                for u in range(unroll):
                    if c + u * tpr < c_end:
                        unpack(words, u * wpc, a)
                        for i in range(vec):
                            a[i] = ptx.ex2_approx((a[i] - m) * scale) * inv
                        store(out, oo + (c + u * tpr) * vec, a, 0)
                c += unroll * tpr
            if tail_live:
                load1(x, xo + tail, w1, 0)
                unpack1(w1, 0, a)
                a[0] = ptx.ex2_approx((a[0] - m) * scale) * inv
                store1(out, oo + tail, a, 0)

    return softmax_split_kernel


def _argmax_kernel_fn(x_kind, vec, tpr, rpb, unroll, split):
    """Grid (row blocks, splits): each span's best (value, index); with ``split`` merged across
    spans through a per-row 64-bit key (``atomicMax``) and a ticket counter."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    scan = _argmax_scan(vec)
    scan1 = _argmax_scan(1)
    reduce = rw.row_pair_reducer(tpr, _argmax_merge, True)
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
                    bv, bi = scan(bv, bi, a, np.int32((c + u * tpr) * vec))
            c += unroll * tpr
        tail = chunks * vec + t
        if has_tail and live and s == splits - 1 and tail < cols:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            bv, bi = scan1(bv, bi, a, np.int32(tail))
        bv, bi = reduce(bv, bi, scratch)
        if not live or t != 0:
            return
        if not split:
            out[row] = np.int64(bi)
            return
        # key: ordered value bits (NaN highest, -0 == 0) above the complemented index
        bits = ptx.f32_bits(bv)
        if bv != bv:
            bits = np.uint32(0x7FFFFFFF)
        elif bv == _F0:
            bits = np.uint32(0)
        if bits & np.uint32(0x80000000):
            ordered = bits ^ _U32_MAX
        else:
            ordered = bits | np.uint32(0x80000000)
        key = (np.uint64(ordered) << np.uint64(32)) | np.uint64(_U32_MAX - np.uint32(bi))
        cuda.atomic.max(keys, row, key)
        cuda.threadfence()
        if cuda.atomic.add(tickets, row, np.uint32(1)) == np.uint32(splits - 1):
            best = cuda.atomic.exch(keys, row, np.uint64(0))
            tickets[row] = np.uint32(0)
            out[row] = np.int64(_U32_MAX - np.uint32(best & np.uint64(0xFFFFFFFF)))

    return argmax_kernel


def _buf(k):
    return array1d(np.float32 if k == rw.KIND_F32 else np.uint16)


def _fused_signature(x_kind, o_kind):
    return (_buf(x_kind), _buf(o_kind), types.int32, types.int32, types.int64, types.int64,
            types.float32)


def _split_signature(x_kind, o_kind):
    f32 = array1d(np.float32)
    return (_buf(x_kind), _buf(o_kind), f32, f32, types.int32, types.int64, types.int64,
            types.int32, types.float32)


def _argmax_signature(x_kind):
    return (_buf(x_kind), array1d(np.int64), array1d(np.uint64), array1d(np.uint32),
            types.int32, types.int32, types.int64, types.int32)


@functools.lru_cache(maxsize=None)
def _softmax_fused_kernel(x_kind, o_kind, vec, tpr, rpb, cpt):
    return Kernel(jit(_softmax_fused_kernel_fn(x_kind, o_kind, vec, tpr, rpb, cpt)),
                  _fused_signature(x_kind, o_kind), "softmax_fused_kernel")


@functools.lru_cache(maxsize=None)
def _softmax_split_kernel(x_kind, o_kind, vec, tpr, unroll, write):
    return Kernel(jit(_softmax_split_kernel_fn(x_kind, o_kind, vec, tpr, unroll, write)),
                  _split_signature(x_kind, o_kind),
                  f"softmax_{'write' if write else 'stats'}_kernel")


@functools.lru_cache(maxsize=None)
def _argmax_kernel(x_kind, vec, tpr, rpb, unroll, split):
    return Kernel(jit(_argmax_kernel_fn(x_kind, vec, tpr, rpb, unroll, split)),
                  _argmax_signature(x_kind), "argmax_kernel")


# ---- workspace -----------------------------------------------------------------------------------

_WORKSPACE = {}
_RETIRED = []  # replaced workspaces stay alive: a captured CUDA graph may still point at them


def _workspace(like, stream, name, size, dtype):
    """A device buffer of at least ``size`` elements, zero when first made, one per (device,
    stream, name): launches on one stream run in order, so they can share it (the argmax kernel
    leaves its keys and tickets zero again). Made with torch when ``like`` is a torch tensor, so
    that a first call inside CUDA-graph capture allocates from the graph's pool and records the
    zeroing; with numba otherwise."""
    device = 0 if SIMULATOR else (like.obj.device.index if like.kind == "torch"
                                  else cuda.get_current_device().id)
    key = (device, stream, name)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape[0] < size:
        if buf is not None:
            _RETIRED.append(buf)
        n = max(size, 1024)
        if SIMULATOR:
            buf = np.zeros(n, dtype)
        elif like.kind == "torch":
            import torch

            storage = {1: torch.uint8, 4: torch.int32, 8: torch.int64}[np.dtype(dtype).itemsize]
            buf = torch.zeros(n, dtype=storage, device=like.obj.device)
        else:
            buf = cuda.to_device(np.zeros(n, dtype))
        _WORKSPACE[key] = buf
    if SIMULATOR:
        return buf
    ptr = buf.data_ptr() if hasattr(buf, "data_ptr") else buf.__cuda_array_interface__["data"][0]
    return Buffer(ptr, buf.shape[0], np.dtype(dtype), buf)


# ---- planning --------------------------------------------------------------------------------

def _prepare(x, name="x"):
    tx = tensor(x, name, dtypes=FLOAT_DTYPES)
    rows, cols, x_stride = rw.rows_view(name, tx)
    if cols == 0:
        raise ValueError(f"{name}: expected a non-empty last dimension, got shape {tx.shape}")
    if cols >= 2**31:
        raise NotImplementedError(f"{name}: rows of at most 2^31 - 1 elements, got {cols}")
    return tx, rows, cols, x_stride


def _splits(rows, chunks, threads):
    """Blocks per row: about ``BLOCKS_PER_SM`` blocks per SM in all, each span at least
    ``MIN_CHUNKS_PER_THREAD`` chunks a thread."""
    want = -(-BLOCKS_PER_SM * sm_count() // max(rows, 1))
    most = max(1, chunks // (threads * MIN_CHUNKS_PER_THREAD))
    return max(1, min(want, most, 65535))


def softmax(x, *, temperature=1.0, dtype=None, out=None, stream=None):
    """Softmax of ``x / temperature`` over the last dimension, accumulated in fp32.

    Args:
        x: (..., vocab) fp16 / bf16 / fp32 logits, last dimension contiguous.
        temperature: float > 0 (finite).
        dtype: output dtype, x's (default) or float32 (a name, numpy or torch dtype).
        out: optional output, x's shape, dtype ``dtype`` (or x's / float32 when ``dtype`` is
            None); may be ``x`` itself when the dtypes agree.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``out``: probabilities, in x's array kind. Rows of -inf only (or with NaN or +inf) are
        NaN, as in torch.

    Raises:
        TypeError: non-arrays, unsupported dtypes, ``out`` / ``dtype`` not x's dtype or float32,
            a non-float temperature.
        ValueError: an empty or non-contiguous last dimension, shapes that disagree, a
            temperature that is not finite and > 0.
    """
    tx, rows, cols, x_stride = _prepare(x)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature}")
    if dtype is not None:
        if not isinstance(dtype, str):  # numpy / ml_dtypes / torch dtype objects
            text = str(dtype)
            dtype = text[len("torch."):] if text.startswith("torch.") else np.dtype(dtype).name
        if dtype not in (tx.dtype, "float32"):
            raise TypeError(f"dtype: expected {tx.dtype} (x's) or float32, got {dtype}")
    if out is not None:
        to = tensor(out, "out")
        want = dtype or (to.dtype if to.dtype in (tx.dtype, "float32") else tx.dtype)
        to = output("out", out, tx.shape, want, tx)
    else:
        out = empty(tx, tx.shape, dtype or tx.dtype)
        to = tensor(out, "out")
    if rows == 0:
        return out
    _, _, o_stride = rw.rows_view("out", to)
    scale = _LOG2E / float(temperature)
    x_kind, o_kind = rw.kind(tx.dtype), rw.kind(to.dtype)
    vec = rw.vector_width(tx.dtype)
    if not (rw.vector_aligned(tx, x_stride, vec) and rw.vector_aligned(to, o_stride, vec)):
        vec = 1
    chunks = cols // vec
    handle = stream_handle(stream, (tx,))
    tpr, rpb, cpt = rw.row_plan(chunks)
    splits = _splits(rows, chunks, SPLIT_THREADS)
    xb, ob = kernel_buffer(tx), kernel_buffer(to)
    if splits == 1 and cpt > 0:
        kernel = _softmax_fused_kernel(x_kind, o_kind, vec, tpr, rpb, cpt)
        kernel(-(-rows // rpb), tpr * rpb,
                  (xb, ob, rows, cols, x_stride, o_stride, scale), handle)
        return out
    span = -(-chunks // splits)
    pm = _workspace(tx, handle, "softmax_max", rows * splits, np.float32)
    pl = _workspace(tx, handle, "softmax_sum", rows * splits, np.float32)
    for write in (False, True):
        kernel = _softmax_split_kernel(x_kind, o_kind, vec, SPLIT_THREADS, UNROLL, write)
        kernel((rows, splits), SPLIT_THREADS,
                  (xb, ob, pm, pl, cols, x_stride, o_stride, span, scale), handle)
    return out


def argmax(x, *, out=None, stream=None):
    """Index of the largest element of each row of ``x`` (..., vocab): greedy sampling.

    Ties go to the lowest index; NaN counts as the largest value (as torch.argmax).

    Returns:
        ``out``: int64, shape ``x.shape[:-1]``, in x's array kind.

    Raises:
        TypeError: non-arrays, unsupported dtypes, ``out`` not int64.
        ValueError: an empty or non-contiguous last dimension, ``out`` of the wrong shape.
    """
    tx, rows, cols, x_stride = _prepare(x)
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
    if not rw.vector_aligned(tx, x_stride, vec):
        vec = 1
    chunks = cols // vec
    handle = stream_handle(stream, (tx,))
    splits = _splits(rows, chunks, SPLIT_THREADS)
    if splits > 1:
        tpr, rpb = SPLIT_THREADS, 1
    else:
        tpr, rpb, _ = rw.row_plan(chunks)
    span = -(-chunks // splits)
    keys = _workspace(tx, handle, "argmax_keys", rows, np.uint64)
    tickets = _workspace(tx, handle, "argmax_tickets", rows, np.uint32)
    kernel = _argmax_kernel(rw.kind(tx.dtype), vec, tpr, rpb, UNROLL, splits > 1)
    kernel((-(-rows // rpb), splits), tpr * rpb,
              (kernel_buffer(tx), kernel_buffer(to), keys, tickets, rows, cols, x_stride, span),
              handle)
    return out


def _register():
    f16, bf16, f32 = rw.KIND_F16, rw.KIND_BF16, rw.KIND_F32
    vec128 = ("LDG.E.128", "STG.E.128")
    checks = {
        "softmax_fused_f16_4096": lambda: (
            _softmax_fused_kernel_fn(f16, f16, 8, *rw.row_plan(512)), _fused_signature(f16, f16)),
        "softmax_stats_f32": lambda: (
            _softmax_split_kernel_fn(f32, f32, 4, SPLIT_THREADS, UNROLL, False),
            _split_signature(f32, f32)),
        "softmax_write_bf16_to_f32": lambda: (
            _softmax_split_kernel_fn(bf16, f32, 8, SPLIT_THREADS, UNROLL, True),
            _split_signature(bf16, f32)),
        "argmax_split_f32": lambda: (
            _argmax_kernel_fn(f32, 4, SPLIT_THREADS, 1, UNROLL, True), _argmax_signature(f32)),
        "argmax_bf16_rows": lambda: (
            _argmax_kernel_fn(bf16, 8, 128, 1, UNROLL, False), _argmax_signature(bf16)),
    }
    for name, build in checks.items():
        must = ("LDG.E.128",) if name.startswith("argmax") or "stats" in name else vec128
        compile_check.register(name, build, sass_must_have=must)


_register()
