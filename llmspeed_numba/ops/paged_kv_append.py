"""Append new tokens' K and V to a paged KV cache.

    pos = seq_lens[b] + t                       (t = 0 .. new_tokens - 1)
    k_cache[block_table[b, pos // block_size], pos % block_size, h, :] = k[b, t, h, :]   (v alike)

Layout: ``k``, ``v`` (batch, new_tokens, nheads_k, headdim); caches (num_blocks, block_size,
nheads_k, headdim); ``block_table`` int32 (batch, max_blocks_per_seq); ``seq_lens`` int32 (batch,)
holds each sequence's length *before* the append and is not modified: afterwards the lengths are
``seq_lens + new_tokens``, which is what ``paged_decode_attention`` takes (``PagedKVCache.append``
does both steps). The pages for the new positions must already be in ``block_table``.

Kernel: one block row per (batch, token), one thread per 16-byte chunk of the token's
``nheads_k * headdim`` values (``ld/st.v4``) when the sources are 16-byte aligned, per element
otherwise. Positions beyond ``max_blocks_per_seq * block_size`` and page ids outside
``[0, num_blocks)`` are skipped, never written (memory-safe for any table contents);
``check_bounds=True`` raises ``ValueError`` for them instead (a device-to-host read; default:
checked when the arrays are host memory, i.e. under the CUDA simulator).
"""

import functools

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import host_ints, kernel_buffer, stream_handle
from .._checks import aligned, boolean, same_dtype, shape, tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from .paged_decode import _check_cache_layout

HALF_DTYPES = ("float16", "bfloat16")
THREADS = 128


def _append_kernel_fn(vec):
    """``vec``: elements a thread copies (8: one 16-byte vector; 1: scalars)."""

    def paged_kv_append_kernel(k, v, kc, vc, bt, sl, skb, skt, skh, skd, svb, svt, svh, svd,
                               ckb, ckt, ckh, cvb, cvt, cvh, sbtb, sbts, ssl,
                               new_tokens, nheads_k, chunks_per_head, max_slots, num_blocks,
                               bs_shift):
        row = cuda.blockIdx.x
        b = row // new_tokens
        t = row - b * new_tokens
        c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if c < nheads_k * chunks_per_head:
            h = c // chunks_per_head
            d = (c - h * chunks_per_head) * vec
            pos = np.int64(sl[b * ssl]) + t
            if pos >= 0 and pos < (np.int64(max_slots) << bs_shift):
                page = np.int64(bt[b * sbtb + (pos >> bs_shift) * sbts])
                if page >= 0 and page < num_blocks:
                    in_page = pos & ((1 << bs_shift) - 1)
                    dk = page * ckb + in_page * ckt + h * ckh + d
                    dv = page * cvb + in_page * cvt + h * cvh + d
                    sk = b * skb + t * skt + h * skh + d * skd
                    sv = b * svb + t * svt + h * svh + d * svd
                    if vec == 8:
                        w0, w1, w2, w3 = ptx.load_u32x4(k, sk)
                        ptx.store_u32x4(kc, dk, w0, w1, w2, w3)
                        w0, w1, w2, w3 = ptx.load_u32x4(v, sv)
                        ptx.store_u32x4(vc, dv, w0, w1, w2, w3)
                    else:
                        kc[dk] = k[sk]
                        vc[dv] = v[sv]

    return paged_kv_append_kernel


_SIGNATURE = ((array1d(np.uint16),) * 4 + (array1d(np.int32),) * 2 + (types.int64,) * 17
              + (types.int32,) * 6)


@functools.lru_cache(maxsize=None)
def _append_kernel(vec):
    return Kernel(jit(_append_kernel_fn(vec)), _SIGNATURE, "paged_kv_append_kernel")


def check_append_tables(block_table, seq_lens, num_blocks, block_size, new_tokens):
    """Host check that every new position has a page in range (host int arrays); ValueError."""
    capacity = block_table.shape[1] * block_size
    table = (f"the block_table's capacity of {capacity} tokens (max_blocks_per_seq "
             f"{block_table.shape[1]} x block_size {block_size})")
    if new_tokens > capacity:
        raise ValueError(f"k: expected at most {capacity} new tokens, {table}, got {new_tokens}")
    negative = np.flatnonzero(seq_lens < 0)
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"seq_lens: expected lengths >= 0, got seq_lens[{b}] = "
                         f"{int(seq_lens[b])}")
    past = np.flatnonzero(seq_lens.astype(np.int64) + new_tokens > capacity)
    if past.size:
        b = int(past[0])
        raise ValueError(f"seq_lens: appending {new_tokens} tokens needs seq_lens[b] + "
                         f"{new_tokens} <= {capacity}, {table}, got seq_lens[{b}] = "
                         f"{int(seq_lens[b])}")
    for b, n in enumerate(seq_lens):
        if new_tokens == 0:
            break
        first, last = int(n) // block_size, (int(n) + new_tokens - 1) // block_size
        used = block_table[b, first:last + 1]
        wrong = np.flatnonzero((used < 0) | (used >= num_blocks))
        if wrong.size:
            j = first + int(wrong[0])
            raise ValueError(f"block_table: expected page ids in [0, {num_blocks}) for the "
                             f"appended positions of sequence {b}, got block_table[{b}, {j}] = "
                             f"{int(block_table[b, j])}")


def check_caches(tkc, tvc, nheads_k, headdim, tables, check_bounds):
    """Check a K / V cache pair that rows of ``nheads_k x headdim`` are appended to (shapes,
    layout, block_size a power of two) and ``check_bounds`` (None: whether the page ``tables``
    are host memory); ``(num_blocks, block_size, check_bounds)``."""
    shape("k_cache", tkc, (None, None, nheads_k, headdim), "to match k's nheads_k and headdim")
    shape("v_cache", tvc, tkc.shape, "to match k_cache")
    _check_cache_layout("k_cache", tkc)
    _check_cache_layout("v_cache", tvc)
    num_blocks, block_size = tkc.shape[:2]
    if block_size < 1 or block_size & (block_size - 1):
        raise NotImplementedError(f"k_cache: block_size {block_size} is not supported; "
                                  f"expected a power of two")
    if check_bounds is None:
        check_bounds = SIMULATOR or tables.kind == "numpy"
    boolean("check_bounds", check_bounds)
    return num_blocks, block_size, check_bounds


_PAGED_KV_APPEND_CALLS = OpCalls("paged_kv_append")


def paged_kv_append(k: ArrayLike, v: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                    block_table: ArrayLike, seq_lens: ArrayLike, *, stream: StreamLike = None,
                    check_bounds: bool | None = None) -> None:
    """Write ``k``, ``v`` (batch, new_tokens, nheads_k, headdim) into the pages of each sequence
    at positions ``seq_lens[b] ..`` (its current length; ``seq_lens`` is not modified).

    Caches: (num_blocks, block_size, nheads_k, headdim), k's dtype (fp16 / bf16), block_size a
    power of two, rows contiguous and 16-byte aligned. ``block_table`` int32 (batch,
    max_blocks_per_seq) must already hold the pages of the new positions. ``check_bounds``: see
    the module docstring. Errors: ``TypeError`` (not an array, dtype, check_bounds not a bool),
    ``ValueError`` (shapes, strides; with checks on, positions past the block_table's capacity
    or without a valid page), ``NotImplementedError`` (block_size not a power of two).
    """
    result = _PAGED_KV_APPEND_CALLS.replay(
        (k, v, k_cache, v_cache, block_table, seq_lens),
        (check_bounds,), stream)
    if result is MISS:
        result = _PAGED_KV_APPEND_CALLS.record(
            _paged_kv_append_checked, k, v, k_cache, v_cache, block_table, seq_lens, stream,
            check_bounds)
    return result


def _paged_kv_append_checked(k, v, k_cache, v_cache, block_table, seq_lens, stream, check_bounds):
    """The checked path of ``paged_kv_append`` (validation, planning, launch)."""
    tk = tensor(k, "k", ndim=4, dtypes=HALF_DTYPES)
    tv = tensor(v, "v", ndim=4)
    tkc = tensor(k_cache, "k_cache", ndim=4)
    tvc = tensor(v_cache, "v_cache", ndim=4)
    tbt = tensor(block_table, "block_table", ndim=2)
    tsl = tensor(seq_lens, "seq_lens", ndim=1)
    batch, new_tokens, nheads_k, headdim = tk.shape
    shape("v", tv, tk.shape, "to match k")
    num_blocks, block_size, check_bounds = check_caches(tkc, tvc, nheads_k, headdim, tbt,
                                                        check_bounds)
    shape("block_table", tbt, (batch, None), "to match k's batch")
    shape("seq_lens", tsl, (batch,), "to match k's batch")
    same_dtype("k", tk, v=tv, k_cache=tkc, v_cache=tvc)
    for name, t in (("block_table", tbt), ("seq_lens", tsl)):
        if t.dtype != "int32":
            raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    for name, t in (("k", tk), ("v", tv), ("block_table", tbt), ("seq_lens", tsl)):
        if any(s < 0 for s in t.strides):
            raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    if check_bounds:
        check_append_tables(host_ints(tbt), host_ints(tsl), num_blocks, block_size,
                            new_tokens)
    if batch * new_tokens * nheads_k * headdim == 0 or tbt.shape[1] == 0:
        return
    vec = 8 if (headdim % 8 == 0 and tk.strides[3] == 1 and tv.strides[3] == 1
                and aligned("k", tk, 8) and aligned("v", tv, 8)) else 1
    chunks_per_head = headdim // vec
    grid = (batch * new_tokens, -(-nheads_k * chunks_per_head // THREADS), 1)
    _append_kernel(vec)(
        grid, THREADS,
        (kernel_buffer(tk), kernel_buffer(tv), kernel_buffer(tkc), kernel_buffer(tvc),
         kernel_buffer(tbt), kernel_buffer(tsl), *tk.strides, *tv.strides, *tkc.strides[:3],
         *tvc.strides[:3], *tbt.strides, tsl.strides[0],
         new_tokens, nheads_k, chunks_per_head, tbt.shape[1], num_blocks,
         block_size.bit_length() - 1),
        stream_handle(stream, (tk, tkc)))


compile_check.register("paged_kv_append", lambda: (_append_kernel_fn(8), _SIGNATURE),
                       sass_must_have=("LDG.E.128", "STG.E.128"))
