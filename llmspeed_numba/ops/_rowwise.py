"""Row-wise building blocks shared by the fused memory-bound ops (norms, softmax, argmax,
activations, rotary embedding).

Rows and chunks
    A ``(..., cols)`` array is a stack of ``rows`` rows of ``cols`` elements, row ``r`` starting at
    element ``r * row_stride`` (``rows_view``). A row is read in *chunks* of ``vec`` elements:
    ``vec = 16 // itemsize`` (one 16-byte ``ld.global.v4``) when every array of the op starts on a
    16-byte boundary and its row stride is a multiple of ``vec``, else ``vec = 1`` (scalar access,
    any alignment). In the vector case the last ``cols % vec`` elements of a row are a scalar tail.

Thread layout (``row_plan``)
    ``threads_per_row`` (a power of two, 8..512) threads share a row; a block of
    ``rows_per_block * threads_per_row`` threads (at least 128) holds several short rows at once.
    Thread ``t`` of a row owns chunks ``t, t + threads_per_row, ...``; with ``chunks_per_thread``
    (a compile-time constant, at most ``MAX_CHUNKS_PER_THREAD``) the whole row sits in registers
    between its reduction and its output pass, so every element is read from memory exactly once.
    Longer rows stream (``chunks_per_thread == 0``): a second pass re-reads them (mostly from L2).

Reductions (``row_reducer``, ``row_pair_reducer``)
    Butterfly shuffles inside a warp (``ptx.shfl_xor_*``, called by all 32 lanes), then one
    shared-memory slot per warp when a row spans several warps. Every thread of the row gets the
    same result (fixed order: deterministic run to run).

Element access
    fp16 / bf16 travel as uint16 bits and fp32 as float32. ``chunk_loader`` / ``chunk_storer``
    move a chunk between memory and ``vec`` float32 slots of a local array (registers after
    inlining); ``chunk_words_loader`` / ``chunk_words_storer`` keep it as raw 32-bit words (half
    the registers for halves: how rows wait in registers) and ``chunk_unpacker`` /
    ``chunk_packer`` convert words to and from float32. ``summed_chunk_loader`` reads a chunk of a
    norm's input, adding (and writing back) the residual.

Launching (``launch``)
    Under the simulator, host buffers are wrapped so a buffer passed twice (in-place outputs) is
    not overwritten by a stale copy.
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from .._overrides import Knobs

#: storage kinds inside kernels (compile-time constants)
KIND_F32, KIND_F16, KIND_BF16 = 0, 1, 2
_KINDS = {"float32": KIND_F32, "float16": KIND_F16, "bfloat16": KIND_BF16}

#: Chunks per thread aimed for by ``row_plan``: 4 independent 16-byte loads in flight per thread
#: (and per array) keep enough bytes in flight per SM to saturate HBM at moderate occupancy.
TARGET_CHUNKS_PER_THREAD = 4
#: Rows longer than ``MAX_THREADS_PER_ROW * MAX_CHUNKS_PER_THREAD`` chunks stream instead of
#: staying in registers (8 chunks = 32 registers of raw row data per array per thread).
MAX_CHUNKS_PER_THREAD = 8
#: At most 512 threads share a row: a 1024-thread block may use only 64 registers a thread, less
#: than the widest register-resident rows need (the launch would fail: too many resources).
MAX_THREADS_PER_ROW = 512
#: Threads of a block that holds several short rows.
MIN_BLOCK_THREADS = 128
#: Smallest number of threads sharing a row.
MIN_THREADS_PER_ROW = 8

#: What ``row_plan`` reads, overridable (scope ``rowwise`` of ``_overrides.overrides``: tests run
#: small blocks under the simulator, or force streaming rows with ``max_chunks_per_thread=0``).
TUNING = Knobs("rowwise", target_chunks_per_thread=TARGET_CHUNKS_PER_THREAD,
               max_chunks_per_thread=MAX_CHUNKS_PER_THREAD, min_block_threads=MIN_BLOCK_THREADS)

_F0 = np.float32(0.0)


def kind(dtype):
    """Compile-time storage kind of a library dtype name."""
    return _KINDS[dtype]


def storage_dtype(dtype):
    """numpy dtype of a kernel buffer of library dtype ``dtype`` (uint16 bits for halves)."""
    return np.dtype(np.float32) if dtype == "float32" else np.dtype(np.uint16)


# ---- host-side planning ----------------------------------------------------------------------

def rows_view(name, t):
    """``(rows, cols, row_stride)`` of ``t`` seen as rows of its last dimension.

    The last dimension must be contiguous and the leading dimensions must collapse into one
    stride (any contiguous array, a slice of rows, a transposed batch of contiguous rows...);
    ``ValueError`` otherwise."""
    if t.ndim == 0:
        raise ValueError(f"{name}: expected at least 1 dimension, got a scalar")
    cols = t.shape[-1]
    if any(n == 0 for n in t.shape):
        return 0, cols, max(cols, 1)
    if cols > 1 and t.strides[-1] != 1:
        raise ValueError(f"{name}: expected the last dimension to be contiguous (stride 1), got "
                         f"strides {t.strides}; call .contiguous() first")
    lead = [(n, s) for n, s in zip(t.shape[:-1], t.strides[:-1]) if n != 1]
    rows = 1
    for n, _ in lead:
        rows *= n
    if not lead:
        return rows, cols, max(cols, 1)
    stride = lead[-1][1]
    expected = stride
    for n, s in reversed(lead):
        if s != expected:
            raise ValueError(
                f"{name}: the leading dimensions of shape {t.shape} with strides {t.strides} do "
                f"not collapse into one row stride; call .contiguous() first")
        expected = s * n
    if stride < 0:
        raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    return rows, cols, stride


def vector_width(dtype):
    """Elements in one 16-byte access of ``dtype``."""
    return 16 // storage_dtype(dtype).itemsize


def vector_aligned(t, row_stride, width):
    """``t`` starts on a 16-byte boundary and its rows start ``width``-element aligned."""
    return t.ptr % 16 == 0 and row_stride % width == 0


def pow2_ceil(n):
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def row_plan(chunks, max_threads=None):
    """``(threads_per_row, rows_per_block, chunks_per_thread)`` for rows of ``chunks`` chunks.

    ``chunks_per_thread == 0`` means the row streams (too long for registers)."""
    tpr = pow2_ceil(-(-max(chunks, 1) // TUNING.target_chunks_per_thread))
    tpr = min(max(tpr, MIN_THREADS_PER_ROW), max_threads or MAX_THREADS_PER_ROW)
    cpt = pow2_ceil(-(-chunks // tpr))  # powers of two: fewer kernel variants to compile
    if cpt > TUNING.max_chunks_per_thread:
        cpt = 0
    rpb = max(1, TUNING.min_block_threads // tpr)
    return tpr, rpb, cpt


# ---- launching -----------------------------------------------------------------------------------

# ---- element access --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _converters(k):
    """``(to_f32, from_f32)`` device functions of storage kind ``k``."""
    if k == KIND_F16:
        return ptx.f16_to_f32, ptx.f32_to_f16
    if k == KIND_BF16:
        return ptx.bf16_to_f32, ptx.f32_to_bf16

    @cuda.jit(device=True, inline="always")
    def f32(x):
        return np.float32(x)

    return f32, f32


def to_f32(k):
    """Device function: one stored element (bits or float32) -> float32."""
    return _converters(k)[0]


def from_f32(k):
    """Device function: float32 -> the stored element (bits or float32), round to nearest."""
    return _converters(k)[1]


@functools.lru_cache(maxsize=None)
def _chunk_io(k, vec):
    """``(load, store)`` of a chunk as float32 values (``chunk_loader`` / ``chunk_storer``)."""
    if vec == 1:
        up, down = _converters(k)

        @cuda.jit(device=True, inline="always")
        def load1(buf, offset, dst, d0):
            dst[d0] = up(buf[offset])

        @cuda.jit(device=True, inline="always")
        def store1(buf, offset, src, s0):
            buf[offset] = down(src[s0])

        return load1, store1
    if k == KIND_F32:
        if vec not in (4, 8):
            raise ValueError(f"fp32 chunks are 4 or 8 elements, got {vec}")
        accesses = vec // 4  # 16-byte ones

        @cuda.jit(device=True, inline="always")
        def load_f32(buf, offset, dst, d0):
            for j in range(accesses):
                w = ptx.load_u32x4(buf, offset + 4 * j)
                dst[d0 + 4 * j] = ptx.f32_from_bits(w[0])
                dst[d0 + 4 * j + 1] = ptx.f32_from_bits(w[1])
                dst[d0 + 4 * j + 2] = ptx.f32_from_bits(w[2])
                dst[d0 + 4 * j + 3] = ptx.f32_from_bits(w[3])

        @cuda.jit(device=True, inline="always")
        def store_f32(buf, offset, src, s0):
            for j in range(accesses):
                ptx.store_u32x4(buf, offset + 4 * j, ptx.f32_bits(src[s0 + 4 * j]),
                                ptx.f32_bits(src[s0 + 4 * j + 1]),
                                ptx.f32_bits(src[s0 + 4 * j + 2]),
                                ptx.f32_bits(src[s0 + 4 * j + 3]))

        return load_f32, store_f32
    if vec != 8:
        raise ValueError(f"half-precision chunks are 8 elements, got {vec}")
    unpack = ptx.unpack_f16x2 if k == KIND_F16 else ptx.unpack_bf16x2
    pack = ptx.pack_f16x2 if k == KIND_F16 else ptx.pack_bf16x2

    @cuda.jit(device=True, inline="always")
    def load_half(buf, offset, dst, d0):
        w = ptx.load_u32x4(buf, offset)
        dst[d0], dst[d0 + 1] = unpack(w[0])
        dst[d0 + 2], dst[d0 + 3] = unpack(w[1])
        dst[d0 + 4], dst[d0 + 5] = unpack(w[2])
        dst[d0 + 6], dst[d0 + 7] = unpack(w[3])

    @cuda.jit(device=True, inline="always")
    def store_half(buf, offset, src, s0):
        ptx.store_u32x4(buf, offset, pack(src[s0], src[s0 + 1]), pack(src[s0 + 2], src[s0 + 3]),
                        pack(src[s0 + 4], src[s0 + 5]), pack(src[s0 + 6], src[s0 + 7]))

    return load_half, store_half


def chunk_loader(k, vec):
    """Device function ``load(buf, offset, dst, d0)``: ``dst[d0 + i] = float32(buf[offset + i])``
    for ``i < vec``. ``vec`` > 1 reads with 16-byte loads (``offset`` must be 16-byte aligned):
    one for 8 halves or 4 floats, two for 8 floats (fp32 weights of a half-precision op)."""
    return _chunk_io(k, vec)[0]


def chunk_storer(k, vec):
    """Device function ``store(buf, offset, src, s0)``: ``buf[offset + i] = src[s0 + i]`` rounded
    to the buffer's precision, for ``i < vec`` (16-byte stores when ``vec`` > 1: one for 8 halves
    or 4 floats, two for 8 floats - fp32 output of a half-precision op)."""
    return _chunk_io(k, vec)[1]


# ---- rows kept in registers as raw words ------------------------------------------------------
# A row held between its reduction and its output pass stays in its storage format: 4 uint32
# words per 16-byte chunk (8 halves or 4 floats), one word per element in scalar mode (the
# element's bits, zero-extended). Halves take half the registers of float32 copies, which keeps
# two or more blocks of 512 threads resident per SM.

def words_per_chunk(vec):
    return 4 if vec > 1 else 1


@functools.lru_cache(maxsize=None)
def _chunk_words_io(k, vec):
    """``(load, store)`` of a chunk kept as raw words (``chunk_words_loader`` / ``_storer``)."""
    if vec > 1:
        @cuda.jit(device=True, inline="always")
        def load4(buf, offset, words, w0):
            w = ptx.load_u32x4(buf, offset)
            words[w0] = w[0]
            words[w0 + 1] = w[1]
            words[w0 + 2] = w[2]
            words[w0 + 3] = w[3]

        @cuda.jit(device=True, inline="always")
        def store4(buf, offset, words, w0):
            ptx.store_u32x4(buf, offset, words[w0], words[w0 + 1], words[w0 + 2], words[w0 + 3])

        return load4, store4
    if k == KIND_F32:
        @cuda.jit(device=True, inline="always")
        def load_f32(buf, offset, words, w0):
            words[w0] = ptx.f32_bits(buf[offset])

        @cuda.jit(device=True, inline="always")
        def store_f32(buf, offset, words, w0):
            buf[offset] = ptx.f32_from_bits(words[w0])

        return load_f32, store_f32

    @cuda.jit(device=True, inline="always")
    def load_u16(buf, offset, words, w0):
        words[w0] = np.uint32(buf[offset])

    @cuda.jit(device=True, inline="always")
    def store_u16(buf, offset, words, w0):
        buf[offset] = np.uint16(words[w0])

    return load_u16, store_u16


def chunk_words_loader(k, vec):
    """Device function ``load(buf, offset, words, w0)``: the chunk at ``offset`` as raw words."""
    return _chunk_words_io(k, vec)[0]


def chunk_words_storer(k, vec):
    """Device function ``store(buf, offset, words, w0)``: raw words back to memory."""
    return _chunk_words_io(k, vec)[1]


@functools.lru_cache(maxsize=None)
def _chunk_codec(k, vec):
    """``(unpack, pack)`` between raw words and float32 (``chunk_unpacker`` / ``chunk_packer``)."""
    if k == KIND_F32:
        @cuda.jit(device=True, inline="always")
        def unpack_f32(words, w0, dst):
            for i in range(vec):
                dst[i] = ptx.f32_from_bits(words[w0 + i])

        @cuda.jit(device=True, inline="always")
        def pack_f32(src, words, w0):
            for i in range(vec):
                words[w0 + i] = ptx.f32_bits(src[i])

        return unpack_f32, pack_f32
    if vec == 1:
        up, down = _converters(k)

        @cuda.jit(device=True, inline="always")
        def unpack1(words, w0, dst):
            dst[0] = up(np.uint16(words[w0]))

        @cuda.jit(device=True, inline="always")
        def pack1(src, words, w0):
            words[w0] = np.uint32(down(src[0]))

        return unpack1, pack1
    unpack = ptx.unpack_f16x2 if k == KIND_F16 else ptx.unpack_bf16x2
    pack = ptx.pack_f16x2 if k == KIND_F16 else ptx.pack_bf16x2

    @cuda.jit(device=True, inline="always")
    def unpack8(words, w0, dst):
        dst[0], dst[1] = unpack(words[w0])
        dst[2], dst[3] = unpack(words[w0 + 1])
        dst[4], dst[5] = unpack(words[w0 + 2])
        dst[6], dst[7] = unpack(words[w0 + 3])

    @cuda.jit(device=True, inline="always")
    def pack8(src, words, w0):
        words[w0] = pack(src[0], src[1])
        words[w0 + 1] = pack(src[2], src[3])
        words[w0 + 2] = pack(src[4], src[5])
        words[w0 + 3] = pack(src[6], src[7])

    return unpack8, pack8


def chunk_unpacker(k, vec):
    """Device function ``unpack(words, w0, dst)``: ``dst[0:vec]`` = the chunk as float32."""
    return _chunk_codec(k, vec)[0]


def chunk_packer(k, vec):
    """Device function ``pack(src, words, w0)``: ``src[0:vec]`` rounded into raw words."""
    return _chunk_codec(k, vec)[1]


@functools.lru_cache(maxsize=None)
def summed_chunk_loader(k, vec, has_residual):
    """Device function ``load(x, xi, residual, ri, words, rwords, a, b)`` of a norm's first pass:
    the chunk of ``x`` at ``xi`` as raw words in ``words[0:wpc]`` and float32 in ``a``; with
    ``has_residual``, first added in fp32 to the residual's chunk at ``ri``, rounded to the
    storage precision and written back there (the sum is then what ``words`` and ``a`` hold;
    ``rwords`` and ``b`` are scratch)."""
    load, store = _chunk_words_io(k, vec)
    unpack, pack = _chunk_codec(k, vec)

    @cuda.jit(device=True, inline="always")
    def load_summed(x, xi, residual, ri, words, rwords, a, b):
        load(x, xi, words, 0)
        unpack(words, 0, a)
        if has_residual:
            load(residual, ri, rwords, 0)
            unpack(rwords, 0, b)
            for i in range(vec):
                a[i] = a[i] + b[i]
            pack(a, words, 0)
            store(residual, ri, words, 0)
            unpack(words, 0, a)

    return load_summed


# ---- reductions ------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def add_f32(a, b):
    return a + b


@cuda.jit(device=True, inline="always")
def max_f32(a, b):
    """max that propagates NaN (as torch.max does)."""
    if a != a:
        return a
    return a if a >= b else b


def scratch_slots(threads_per_row, rows_per_block):
    """float32 shared-memory slots a block needs for ``row_reducer`` (at least 1)."""
    return max(1, rows_per_block * (threads_per_row // 32))


@functools.lru_cache(maxsize=None)
def row_reducer(threads_per_row, combine):
    """Device function ``reduce(value, scratch) -> total`` over the ``threads_per_row``
    consecutive threads sharing a row, for a float32 ``combine`` (``add_f32``, ``max_f32``).

    Must be called by every thread of the block (it shuffles and, for rows wider than a warp,
    synchronises the block); ``scratch`` is a float32 shared array of ``scratch_slots`` slots."""
    width = min(threads_per_row, 32)
    warps = threads_per_row // 32

    @cuda.jit(device=True, inline="always")
    def reduce(value, scratch):
        mask = width // 2
        while mask > 0:
            value = combine(value, ptx.shfl_xor_f32(value, mask))
            mask //= 2
        if warps > 1:
            tid = cuda.threadIdx.x
            warp = tid // 32
            cuda.syncthreads()  # the previous reduction's readers are done with scratch
            if tid % 32 == 0:
                scratch[warp] = value
            cuda.syncthreads()
            base = warp - warp % warps
            value = scratch[base]
            for i in range(1, warps):
                value = combine(value, scratch[base + i])
        return value

    return reduce


@functools.lru_cache(maxsize=None)
def row_pair_reducer(threads_per_row, combine, second_is_int):
    """Like ``row_reducer`` for a pair ``(a, b)``: ``a`` float32, ``b`` float32 or int32
    (``second_is_int``); ``combine(a1, b1, a2, b2) -> (a, b)``. ``scratch`` is one float32
    shared array of ``2 * scratch_slots`` slots (an int32 ``b`` travels as its bits)."""
    width = min(threads_per_row, 32)
    warps = threads_per_row // 32
    shfl_b = ptx.shfl_xor_i32 if second_is_int else ptx.shfl_xor_f32
    if second_is_int:
        @cuda.jit(device=True, inline="always")
        def to_slot(b):
            return ptx.f32_from_bits(np.uint32(b))

        @cuda.jit(device=True, inline="always")
        def from_slot(x):
            return np.int32(ptx.f32_bits(x))
    else:
        @cuda.jit(device=True, inline="always")
        def to_slot(b):
            return b

        @cuda.jit(device=True, inline="always")
        def from_slot(x):
            return x

    @cuda.jit(device=True, inline="always")
    def reduce(a, b, scratch):
        mask = width // 2
        while mask > 0:
            a2 = ptx.shfl_xor_f32(a, mask)
            b2 = shfl_b(b, mask)
            a, b = combine(a, b, a2, b2)
            mask //= 2
        if warps > 1:
            tid = cuda.threadIdx.x
            warp = tid // 32
            half = cuda.blockDim.x // 32
            cuda.syncthreads()
            if tid % 32 == 0:
                scratch[warp] = a
                scratch[half + warp] = to_slot(b)
            cuda.syncthreads()
            base = warp - warp % warps
            a = scratch[base]
            b = from_slot(scratch[half + base])
            for i in range(1, warps):
                a, b = combine(a, b, scratch[base + i], from_slot(scratch[half + base + i]))
        return a, b

    return reduce
