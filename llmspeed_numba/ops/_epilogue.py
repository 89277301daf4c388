"""Device helpers shared by the GEMM kernels: element access by storage dtype, the fused
epilogue, and grouped block rasterisation (all inline).

Kernels see fp16 / bf16 arrays as ``uint16`` bits and fp32 as ``float32`` (``_arrays.STORAGE``);
``loader(dtype)`` / ``storer(dtype)`` return the device function that reads / writes one element
of a flat buffer as float32 for the library dtype name ``dtype``. ``epilogue(...)`` builds the
per-element tail every GEMM kernel shares:

    out[m, n] = activation(alpha * acc + beta * c[m, n] + bias[n])     (rounded once to out's dtype)

All choices (dtypes, whether c / bias exist, the activation) are closure constants, so a kernel
without ``c`` has no load of ``c`` at all.

The gated activations (``gated_epilogue``, ``gated_tile_store``) pair a gate column with its up
column, ``GATE_BLOCK`` columns to its right in the interleaved operand (``ops/gemm_gated.py``):

    out[m, j] = act(alpha * acc[m, n] + bias[n]) * (alpha * acc[m, n + 8] + bias[n + 8]),
    n = 16 * (j // 8) + j % 8
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from ._activations_device import GATED_ACTIVATIONS, activation
from ._last_block import last_block

#: Gate (and up) columns per block of the interleaved gate / up operand: the width of one n8
#: accumulator fragment (mma.sync m16n8k16's, and each 8-column block of a wgmma accumulator),
#: so a thread holds a gate value and its up value at the same place of two neighbouring
#: fragments.
GATE_BLOCK = 8
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)


@cuda.jit(device=True, inline="always")
def gate_column(j):
    """The interleaved operand's gate column of gated output column ``j`` (its up column is
    ``GATE_BLOCK`` further)."""
    return (j // GATE_BLOCK) * (2 * GATE_BLOCK) + j % GATE_BLOCK


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


# Kernel factories capture device functions, never @intrinsic objects: numba's disk-cache key
# hashes the pickled closure, and an intrinsic pickles differently in every process.
@cuda.jit(device=True, inline="always")
def _pack_f16(lo, hi):
    return ptx.pack_f16x2(lo, hi)


@cuda.jit(device=True, inline="always")
def _pack_bf16(lo, hi):
    return ptx.pack_bf16x2(lo, hi)


_LOADERS = {"float16": _load_f16, "bfloat16": _load_bf16, "float32": _load_f32}
_STORERS = {"float16": _store_f16, "bfloat16": _store_bf16, "float32": _store_f32}


def loader(dtype):
    """Device function ``(buf, i) -> float32`` reading element ``i`` of a ``dtype`` buffer."""
    return _LOADERS[dtype]


def storer(dtype):
    """Device function ``(buf, i, v)`` writing float32 ``v`` rounded to ``dtype``."""
    return _STORERS[dtype]


def packer(dtype):
    """Device function ``(lo, hi) -> uint32``: two float32 rounded to fp16 / bf16 ``dtype`` and
    packed, ``lo`` in the low half."""
    return _pack_bf16 if dtype == "bfloat16" else _pack_f16


def epilogue_tile_ld(block_n):
    """fp32 row stride of a staged epilogue tile: +4 floats puts the 8 rows a warp writes at once
    in different banks (4 * row + column) and keeps rows 16-byte aligned."""
    return block_n + 4


@functools.cache
def epilogue_value(c_dtype, bias_dtype, act, fast=False):
    """Device function ``(acc, n, c, c_index, bias, alpha, beta) -> float32`` computing
    ``act(alpha * acc + beta * c[c_index] + bias[n])``.

    ``c_dtype`` / ``bias_dtype`` are None when there is no ``c`` (or ``beta == 0``) / no bias;
    the buffers passed for them are then never read. ``fast``: the activation's SFU form (for
    results rounded to fp16 / bf16: relative error under a tenth of an fp16 ulp), a few
    instructions where libdevice's ``expf`` and IEEE division take tens, once per output
    element of an epilogue that does not overlap the block's MMAs.
    """
    load_bias = loader(bias_dtype) if bias_dtype is not None else _load_f32
    has_bias = bias_dtype is not None
    with_bias = epilogue_value_of_bias(c_dtype, has_bias, act, fast)

    @cuda.jit(device=True, inline="always")
    def value(acc, n, c, c_index, bias, alpha, beta):
        return with_bias(acc, load_bias(bias, n) if has_bias else _ZERO, c, c_index, alpha,
                         beta)

    return value


@functools.cache
def epilogue_value_of_bias(c_dtype, has_bias, act, fast=False):
    """``epilogue_value`` with the bias already loaded: ``(acc, bias_value, c, c_index, alpha,
    beta) -> float32`` (``bias_value`` is not added when ``has_bias`` is false)."""
    load_c = loader(c_dtype) if c_dtype is not None else _load_f32
    has_c = c_dtype is not None
    act_fn = activation(act, fast=fast)

    @cuda.jit(device=True, inline="always")
    def value(acc, bias_value, c, c_index, alpha, beta):
        v = alpha * acc
        if has_c:
            v += beta * load_c(c, c_index)
        if has_bias:
            v += bias_value
        return act_fn(v)

    return value


@functools.cache
def bias_loader(bias_dtype, count):
    """Device function ``(bias, n, N) -> tuple of count float32``: ``bias[n .. n + count - 1]``,
    zero past ``N`` (and everywhere without a bias)."""
    load_bias = loader(bias_dtype) if bias_dtype is not None else _load_f32
    has_bias = bias_dtype is not None

    @cuda.jit(device=True, inline="always")
    def one(bias, n, N):
        if has_bias and n < N:
            return load_bias(bias, n)
        return _ZERO

    @cuda.jit(device=True, inline="always")
    def four(bias, n, N):
        return one(bias, n, N), one(bias, n + 1, N), one(bias, n + 2, N), one(bias, n + 3, N)

    @cuda.jit(device=True, inline="always")
    def eight(bias, n, N):
        return four(bias, n, N) + four(bias, n + 4, N)

    return four if count == 4 else eight


@functools.cache
def epilogue(out_dtype, c_dtype, bias_dtype, act):
    """Device function ``(acc, n, out, out_index, c, c_index, bias, alpha, beta)`` that stores
    the ``epilogue_value`` of one accumulator at ``out[out_index]``, rounded to ``out_dtype``."""
    store = storer(out_dtype)
    value = epilogue_value(c_dtype, bias_dtype, act, out_dtype != "float32")

    @cuda.jit(device=True, inline="always")
    def apply(acc, n, out, out_index, c, c_index, bias, alpha, beta):
        store(out, out_index, value(acc, n, c, c_index, bias, alpha, beta))

    return apply


def vector_width(out_dtype):
    """Output elements per 16-byte store: 8 fp16 / bf16 or 4 fp32."""
    return 4 if out_dtype == "float32" else 8


@cuda.jit(device=True, inline="always")
def _round_f16(v):
    return ptx.f16_to_f32(ptx.f32_to_f16(v))


@cuda.jit(device=True, inline="always")
def _round_bf16(v):
    return ptx.bf16_to_f32(ptx.f32_to_bf16(v))


@cuda.jit(device=True, inline="always")
def _round_f32(v):
    return v


_ROUNDERS = {"float16": _round_f16, "bfloat16": _round_bf16, "float32": _round_f32}


@functools.cache
def accumulating_epilogue(out_dtype, bias_dtype):
    """Device function ``(acc, n, out, out_index, c, c_index, bias, alpha, beta)`` (``epilogue``'s
    parameters; ``c``, ``alpha``, ``beta`` unused) that adds ``acc + bias[n]``, rounded to
    ``out_dtype``, into ``out[out_index]``, the sum rounded again: a projection stored, then added
    into the residual stream (what ``rms_norm``'s ``residual`` does with it), in one store."""
    value = epilogue_value(None, bias_dtype, None)
    round_out = _ROUNDERS[out_dtype]
    load = loader(out_dtype)
    store = storer(out_dtype)

    @cuda.jit(device=True, inline="always")
    def apply(acc, n, out, out_index, c, c_index, bias, alpha, beta):
        store(out, out_index, round_out(value(acc, n, c, c_index, bias, _ONE, _ZERO))
              + load(out, out_index))

    return apply


@functools.cache
def vector_epilogue(out_dtype, c_dtype, bias_dtype, act):
    """Device function ``(src, src_index, bias_values, out, out_index, c, c_index, sc_n,
    alpha, beta)``: the epilogue of ``vector_width(out_dtype)`` consecutive accumulators, read
    from the fp32 array ``src`` (16-byte aligned index), for output columns ``n, n + 1, ...``
    whose biases are ``bias_values`` (loaded by the caller, once for all the rows it stores),
    stored with one 16-byte store at ``out[out_index]`` (16-byte aligned). ``c``'s column stride
    is ``sc_n``.
    """
    value = epilogue_value_of_bias(c_dtype, bias_dtype is not None, act,
                                   out_dtype != "float32")
    pack = packer(out_dtype)
    fp32 = out_dtype == "float32"

    @cuda.jit(device=True, inline="always")
    def four(src, i, b0, b1, b2, b3, c, c_index, sc_n, alpha, beta):
        w0, w1, w2, w3 = ptx.load_u32x4(src, i)
        return (value(ptx.f32_from_bits(w0), b0, c, c_index, alpha, beta),
                value(ptx.f32_from_bits(w1), b1, c, c_index + sc_n, alpha, beta),
                value(ptx.f32_from_bits(w2), b2, c, c_index + 2 * sc_n, alpha, beta),
                value(ptx.f32_from_bits(w3), b3, c, c_index + 3 * sc_n, alpha, beta))

    @cuda.jit(device=True, inline="always")
    def apply16(src, i, bias_values, out, out_index, c, c_index, sc_n, alpha, beta):
        """``bias_values``: ``bias_loader(bias_dtype, vector_width(out_dtype))``'s tuple."""
        v0, v1, v2, v3 = four(src, i, bias_values[0], bias_values[1], bias_values[2],
                              bias_values[3], c, c_index, sc_n, alpha, beta)
        if fp32:
            ptx.store_u32x4(out, out_index, ptx.f32_bits(v0), ptx.f32_bits(v1),
                            ptx.f32_bits(v2), ptx.f32_bits(v3))
        else:
            v4, v5, v6, v7 = four(src, i + 4, bias_values[4], bias_values[5], bias_values[6],
                                  bias_values[7], c, c_index + 4 * sc_n, sc_n, alpha, beta)
            ptx.store_u32x4(out, out_index, pack(v0, v1), pack(v2, v3), pack(v4, v5),
                            pack(v6, v7))

    return apply16


@functools.cache
def tile_epilogue(block_m, block_n, tile_ld, threads, out_dtype, c_dtype, bias_dtype, act):
    """Device function storing a block's fp32 result tile, staged in shared memory, through the
    epilogue: ``(tile, tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias, alpha,
    beta, out_vec)``. ``tile[r * tile_ld + col]`` holds output (m0 + r, n0 + col); every thread
    takes ``vector_width`` consecutive columns of a row at a time, one 16-byte store when
    ``out_vec`` (unit column stride, 16-byte aligned rows), else element by element; rows and
    columns past M and N are not stored. Coalesced, and one small loop instead of an unrolled
    copy per accumulator register (which spills)."""
    apply_epilogue = epilogue(out_dtype, c_dtype, bias_dtype, act)
    apply_vector = vector_epilogue(out_dtype, c_dtype, bias_dtype, act)
    vec = vector_width(out_dtype)
    load_biases = bias_loader(bias_dtype, vec)
    groups_per_row = block_n // vec
    # each thread keeps its columns for every row it stores (the usual case: threads a
    # multiple of the row's groups), so it loads their biases once, not once a row
    fixed_columns = threads % groups_per_row == 0
    row_step = threads // groups_per_row

    @cuda.jit(device=True, inline="always")
    def store_scalars(tile, t_off, col, cols, m, n, out, out_base, so_m, so_n, c, sc_m, sc_n,
                      bias, alpha, beta):
        """Columns ``col .. col + vec - 1`` of a row one by one (edge columns, strided out)."""
        for e in range(vec):
            if col + e < cols:
                apply_epilogue(tile[t_off + e], n + e, out, out_base + m * so_m + (n + e) * so_n,
                               c, m * sc_m + (n + e) * sc_n, bias, alpha, beta)

    @cuda.jit(device=True, inline="always")
    def store_tile(tile, tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias,
                   alpha, beta, out_vec):
        rows = min(block_m, M - m0)
        cols = min(block_n, N - n0)
        if fixed_columns:
            col = (tid % groups_per_row) * vec
            n = n0 + col
            bias_values = load_biases(bias, n, N)
            for r in range(tid // groups_per_row, rows, row_step):
                m = m0 + r
                t_off = r * tile_ld + col
                if out_vec != 0 and col + vec <= cols:
                    apply_vector(tile, t_off, bias_values, out, out_base + m * so_m + n, c,
                                 m * sc_m + n * sc_n, sc_n, alpha, beta)
                else:
                    store_scalars(tile, t_off, col, cols, m, n, out, out_base, so_m, so_n, c,
                                  sc_m, sc_n, bias, alpha, beta)
            return
        for gi in range(tid, rows * groups_per_row, threads):
            r = gi // groups_per_row
            col = (gi % groups_per_row) * vec
            m = m0 + r
            n = n0 + col
            t_off = r * tile_ld + col
            if out_vec != 0 and col + vec <= cols:
                apply_vector(tile, t_off, load_biases(bias, n, N), out, out_base + m * so_m + n,
                             c, m * sc_m + n * sc_n, sc_n, alpha, beta)
            else:
                store_scalars(tile, t_off, col, cols, m, n, out, out_base, so_m, so_n, c, sc_m,
                              sc_n, bias, alpha, beta)

    return store_tile


@cuda.jit(device=True, inline="always")
def grouped_tile(pid, tiles_m, tiles_n, group_m):
    """(tile row, tile column) of block ``pid`` in grouped order: blocks walk down a group of
    ``group_m`` tile rows column by column, so a wave of blocks shares A rows and B columns in
    L2. uint32 arithmetic: numba's int64 division is a slow library call on the GPU."""
    pid = np.uint32(pid)
    in_group = np.uint32(np.uint32(group_m) * np.uint32(tiles_n))
    first_m = np.uint32(np.uint32(pid // in_group) * np.uint32(group_m))
    rows = np.uint32(min(np.uint32(tiles_m) - first_m, np.uint32(group_m)))
    r = np.uint32(pid % in_group)
    return np.int32(first_m + np.uint32(r % rows)), np.int32(r // rows)


@functools.cache
def block_work(block_m, block_n, block_k, group_m):
    """Device function ``(tiles_m, tiles_n, K, k_split) -> (m0, n0, z, k_begin, k_end,
    k_tiles)``: the output tile of this block (``grouped_tile`` order) and the K range of its
    split ``z = blockIdx.y``, in ``block_k`` tiles."""
    @cuda.jit(device=True, inline="always")
    def work(tiles_m, tiles_n, K, k_split):
        pid_m, pid_n = grouped_tile(cuda.blockIdx.x, tiles_m, tiles_n, group_m)
        z = cuda.blockIdx.y
        k_begin = z * k_split
        k_end = min(K, k_begin + k_split)
        return (pid_m * block_m, pid_n * block_n, z, k_begin, k_end,
                (k_end - k_begin + block_k - 1) // block_k)

    return work


@functools.cache
def gated_epilogue(bias_dtype, gated_act, out_dtype):
    """Device functions of a gated activation (one of ``GATED_ACTIVATIONS``) whose result is
    rounded to ``out_dtype``: the activation's SFU form for fp16 / bf16 results (relative error
    under a tenth of an fp16 ulp, as ``activations.silu_and_mul`` on half-precision data),
    libdevice's for fp32 ones (``_activations_device``):

    - ``bias_pair(bias, n, N) -> (bias_gate, bias_up)``: the biases of gate column ``n`` of b and
      of its up column ``n + GATE_BLOCK``; zeros without a bias, and for ``n >= N`` (columns of
      an edge tile past b's end, whose accumulators are zeros: nothing is read there);
    - ``combine(gate, up, bias_gate, bias_up, alpha) -> float32``:
      ``act(alpha * gate + bias_gate) * (alpha * up + bias_up)`` in fp32.
    """
    has_bias = bias_dtype is not None
    load_bias = loader(bias_dtype) if has_bias else _load_f32
    act_fn = activation(GATED_ACTIVATIONS[gated_act], fast=out_dtype != "float32")

    @cuda.jit(device=True, inline="always")
    def bias_pair(bias, n, N):
        if has_bias and n < N:
            return load_bias(bias, n), load_bias(bias, n + GATE_BLOCK)
        return _ZERO, _ZERO

    @cuda.jit(device=True, inline="always")
    def combine(gate, up, bias_gate, bias_up, alpha):
        g = alpha * gate
        u = alpha * up
        if has_bias:
            g += bias_gate
            u += bias_up
        return act_fn(g) * u

    return bias_pair, combine


@functools.cache
def gated_fragment(bias_dtype, gated_act, out_dtype, tile_ld):
    """Device function ``(tile, t, g0, g1, g2, g3, u0, u1, u2, u3, n, N, bias, alpha)``: the
    gated results of one thread's part of an n8 fragment pair, gate values ``g0 .. g3`` and up
    values ``u0 .. u3`` at (row r, column c), (r, c + 1), (r + 8, c), (r + 8, c + 1) (the
    accumulator order of mma.sync and of each wgmma 8-column block), ``n`` b's gate column c,
    stored at ``tile[t]``, ``tile[t + 1]``, ``tile[t + 8 tile_ld]``, ``tile[t + 8 tile_ld +
    1]``. The biases are loaded here, next to their use (loaded once for several fragments,
    they held registers the 128 x 256 mma.sync tile's GELU epilogue spilled for)."""
    bias_pair, combine = gated_epilogue(bias_dtype, gated_act, out_dtype)
    row8 = 8 * tile_ld

    @cuda.jit(device=True, inline="always")
    def store_fragment(tile, t, g0, g1, g2, g3, u0, u1, u2, u3, n, N, bias, alpha):
        bg0, bu0 = bias_pair(bias, n, N)
        bg1, bu1 = bias_pair(bias, n + 1, N)
        tile[t] = combine(g0, u0, bg0, bu0, alpha)
        tile[t + 1] = combine(g1, u1, bg1, bu1, alpha)
        tile[t + row8] = combine(g2, u2, bg0, bu0, alpha)
        tile[t + row8 + 1] = combine(g3, u3, bg1, bu1, alpha)

    return store_fragment


@functools.cache
def gated_tile_store(block_m, block_n, tile_ld, threads, out_dtype):
    """``tile_epilogue``'s store for a gated block: the staged tile holds the block's
    ``block_n / 2`` finished output columns (``act(gate) * up``, bias included), which are
    stored as they are (rounded to ``out_dtype``). Same parameters as ``tile_epilogue``'s
    ``store_tile``, with ``n0`` and ``N`` counting b's (interleaved) columns; ``c``, ``bias``,
    ``alpha`` and ``beta`` are not used."""
    store_half = tile_epilogue(block_m, block_n // 2, tile_ld, threads, out_dtype, None, None,
                               None)

    @cuda.jit(device=True, inline="always")
    def store_tile(tile, tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias,
                   alpha, beta, out_vec):
        store_half(tile, tid, m0, n0 >> 1, M, N >> 1, out, out_base, so_m, so_n, c, sc_m, sc_n,
                   bias, _ONE, _ZERO, out_vec)

    return store_tile


@functools.cache
def gated_raw_store(block_m, block_n, tile_ld, threads, out_dtype, bias_dtype, gated_act):
    """Device function ``(tile, tid, m0, n0, M, N, out, so_m, so_n, bias, alpha)``: the gated
    epilogue of a staged tile of raw fp32 sums (b's interleaved columns ``n0 ..``, as a plain
    GEMM stages them): output column ``n0 / 2 + j`` is ``combine`` of tile columns ``n`` and
    ``n + GATE_BLOCK``, ``n = 2 GATE_BLOCK (j // GATE_BLOCK) + j % GATE_BLOCK``. Element by
    element: it runs once per split tile, after the partial sums are added."""
    bias_pair, combine = gated_epilogue(bias_dtype, gated_act, out_dtype)
    store = storer(out_dtype)
    half = block_n // 2

    @cuda.jit(device=True, inline="always")
    def store_gated(tile, tid, m0, n0, M, N, out, so_m, so_n, bias, alpha):
        rows = min(block_m, M - m0)
        for e in range(tid, rows * half, threads):
            r = e // half
            j = e - r * half
            col = gate_column(j)
            n = n0 + col
            if n < N:
                bias_gate, bias_up = bias_pair(bias, n, N)
                t = r * tile_ld + col
                store(out, (m0 + r) * so_m + ((n0 >> 1) + j) * so_n,
                      combine(tile[t], tile[t + GATE_BLOCK], bias_gate, bias_up, alpha))

    return store_gated


#: ``split_tile_finish`` on rows of the whole tile width: each thread sums ``SUM_VECS`` of its
#: 4-column groups at once, the partials of ``SUM_SPLITS`` splits loaded before any is added, so
#: that 16 workspace reads are in flight instead of one L2 round trip per group and split.
SUM_VECS = 4
SUM_SPLITS = 4


@functools.cache
def split_tile_finish(block_m, block_n, tile_ld, threads, out_dtype, c_dtype, bias_dtype, act):
    """Split K finished in the GEMM's own launch. Device function ``(tile, tid, m0, n0, M, N,
    out, out_base, so_m, so_n, c, sc_m, sc_n, bias, alpha, beta, out_vec, ws, counters)`` (a
    plain store's parameters, ``out_base`` unused, then the workspace and tickets) for a block
    whose raw fp32 sums (its K split, ``blockIdx.y`` of ``gridDim.y``) are staged in ``tile``:
    it writes them to ``ws`` (splits, M, N) and draws a ticket from ``counters[blockIdx.x]``
    (int32, zero before the launch and left zero); the block of the tile that finishes last
    adds the splits' sums in split order (the same order, so the same bits, whichever block is
    last) and stores the tile through the epilogue (gated ones included). One kernel instead of
    a GEMM and a reduce kernel: a launch less, and the partial sums are read back from L2."""
    save_raw = tile_epilogue(block_m, block_n, tile_ld, threads, "float32", None, None, None)
    gated = act in GATED_ACTIVATIONS
    # both names bound (the kernel-cache key describes every closure cell)
    store_gated = store_plain = None
    if gated:
        store_gated = gated_raw_store(block_m, block_n, tile_ld, threads, out_dtype, bias_dtype,
                                      act)
    else:
        store_plain = tile_epilogue(block_m, block_n, tile_ld, threads, out_dtype, c_dtype,
                                    bias_dtype, act)
    groups = block_n // 4
    whole_groups = block_m * groups
    rounds = (whole_groups + threads * SUM_VECS - 1) // (threads * SUM_VECS)
    n_parts = 4 * SUM_VECS * SUM_SPLITS    # (closure constants: local array sizes)
    n_sums = 4 * SUM_VECS

    @cuda.jit(device=True, inline="always")
    def add_rows(tile, tid, m0, n0, N, mn, splits, ws, rows, cols):
        """The tile's first ``rows`` rows and ``cols`` columns (a multiple of 4) with 16-byte
        workspace rows: the batched sums of ``SUM_VECS`` 4-column groups."""
        groups_left = rows * groups
        parts = cuda.local.array(n_parts, np.float32)
        sums = cuda.local.array(n_sums, np.float32)
        for rnd in range(rounds):
            for v in range(n_sums):
                sums[v] = _ZERO
            for z0 in range(0, splits, SUM_SPLITS):
                for j in range(SUM_VECS):
                    gi = tid + (rnd * SUM_VECS + j) * threads
                    r = gi // groups
                    col = (gi - r * groups) * 4
                    src = (m0 + r) * N + n0 + col
                    for u in range(SUM_SPLITS):
                        if gi < groups_left and col < cols and z0 + u < splits:
                            w0, w1, w2, w3 = ptx.load_u32x4(ws, (z0 + u) * mn + src)
                            e = 4 * (j * SUM_SPLITS + u)
                            parts[e] = ptx.f32_from_bits(w0)
                            parts[e + 1] = ptx.f32_from_bits(w1)
                            parts[e + 2] = ptx.f32_from_bits(w2)
                            parts[e + 3] = ptx.f32_from_bits(w3)
                for j in range(SUM_VECS):
                    for u in range(SUM_SPLITS):   # split order: the same bits every call
                        if z0 + u < splits:
                            e = 4 * (j * SUM_SPLITS + u)
                            for q in range(4):
                                sums[4 * j + q] += parts[e + q]
            for j in range(SUM_VECS):
                gi = tid + (rnd * SUM_VECS + j) * threads
                r = gi // groups
                col = (gi - r * groups) * 4
                if gi < groups_left and col < cols:
                    t = r * tile_ld + col
                    for q in range(4):
                        tile[t + q] = sums[4 * j + q]

    @cuda.jit(device=True, inline="always")
    def finish(tile, tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias, alpha,
               beta, out_vec, ws, counters):
        mn = M * N
        ws_vec = np.int32((N & 3) == 0)   # 16-byte rows (the workspace is 16-byte aligned)
        save_raw(tile, tid, m0, n0, M, N, ws, cuda.blockIdx.y * mn, N, 1, ws, 0, 0, ws, _ONE,
                 _ZERO, ws_vec)
        splits = cuda.gridDim.y
        if last_block(counters, cuda.blockIdx.x, 1, splits) == 0:
            return
        rows = min(block_m, M - m0)
        cols = min(block_n, N - n0)
        if ws_vec != 0:   # N a multiple of 4, so is cols
            add_rows(tile, tid, m0, n0, N, mn, splits, ws, rows, cols)
        else:
            for gi in range(tid, rows * groups, threads):
                r = gi // groups
                col = (gi - r * groups) * 4
                src = (m0 + r) * N + n0 + col
                t = r * tile_ld + col
                for e in range(4):
                    if col + e < cols:
                        s = _ZERO
                        for z in range(splits):
                            s += ws[z * mn + src + e]
                        tile[t + e] = s
        cuda.syncthreads()
        if gated:
            store_gated(tile, tid, m0, n0, M, N, out, so_m, so_n, bias, alpha)
        else:
            store_plain(tile, tid, m0, n0, M, N, out, 0, so_m, so_n, c, sc_m, sc_n, bias, alpha,
                        beta, out_vec)

    return finish


def staged_store(split_finish, staged_epilogue, block_m, block_n, threads, out_dtype, c_dtype,
                 bias_dtype, act):
    """``(stage_acc, store)`` of a Tensor Core kernel: ``staged_epilogue(out_dtype, c_dtype,
    bias_dtype, act)`` is the kernel's own ``(stage_acc, store_tile)`` factory. ``store(tile,
    tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias, alpha, beta, out_vec, ws,
    counters)``: with ``split_finish`` the raw sums are staged and ``split_tile_finish`` adds the
    splits and runs the epilogue; else the staged epilogue (``ws``, ``counters`` unused)."""
    if split_finish:
        stage_acc, _ = staged_epilogue("float32", None, None, None)
        return stage_acc, split_tile_finish(block_m, block_n, epilogue_tile_ld(block_n), threads,
                                            out_dtype, c_dtype, bias_dtype, act)
    stage_acc, store_tile = staged_epilogue(out_dtype, c_dtype, bias_dtype, act)

    @cuda.jit(device=True, inline="always")
    def store(tile, tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias, alpha,
              beta, out_vec, ws, counters):
        store_tile(tile, tid, m0, n0, M, N, out, out_base, so_m, so_n, c, sc_m, sc_n, bias,
                   alpha, beta, out_vec)

    return stage_acc, store
