"""Rotary embedding of q and k and the paged KV-cache append of k and v, in one kernel.

A decoder layer rotates its new tokens' q and k (``rotary_embedding``) and then writes k and v
into the paged cache (``paged_kv_append``, each token a one-token sequence at its own position):
two launches a layer, the second re-reading the k the first just wrote. Here, for token ``t`` at
position ``p = positions[t]``:

    q[t], k[t] rotated in place                         (exactly as rotary_embedding)
    k_cache[page, p % block_size] = k[t]  (rotated),  v_cache[page, p % block_size] = v[t]
    page = token_tables[t, p // block_size]

bit for bit what the two ops write (within bounds, below). k is rotated in place as well because a prefill's attention
reads the new tokens' k from it (``flash_attn_varlen``), not from the cache.

Layout: ``q`` (tokens, nheads, headdim), ``k`` and ``v`` (tokens, nheads_k, headdim), fp16 /
bf16, last dimension contiguous, any token and head strides (slices of a packed qkv tensor);
caches (num_blocks, block_size, nheads_k, headdim) of that dtype, block_size a power of two, as
``paged_kv_append`` takes them; ``token_tables`` int32 (tokens, max_blocks_per_seq): each token's
sequence's pages; ``positions`` (tokens,) int32 / int64.

Bounds: a token whose position is outside ``cos_sin_cache`` is neither rotated nor appended;
one whose position has no page in range (past the table's width, a page id outside ``[0,
num_blocks)``) is rotated, not appended: the kernel never reads or writes out of bounds.
``check_bounds=True`` raises ``ValueError`` for either instead (reads positions and tables back
to the host: a synchronisation); default: checked when the tables are host memory (the
simulator).

Kernel: ``rotary``'s, one block a token; its threads first copy v and k's elements past
``rotary_dim`` into the cache (16-byte chunks where every array allows them), then rotate q and
k, storing each rotated k chunk both in place and in the cache.
"""

import numpy as np

from .._arrays import host_ints, kernel_buffer, stream_handle
from .._checks import same_dtype, shape, tensor
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from .paged_kv_append import HALF_DTYPES, check_caches
from .rotary import plan_rotary

_ROTARY_KV_APPEND_CALLS = OpCalls("rotary_kv_append")


def rotary_kv_append(q: ArrayLike, k: ArrayLike, v: ArrayLike, k_cache: ArrayLike,
                     v_cache: ArrayLike, token_tables: ArrayLike, positions: ArrayLike, *,
                     base: float = 10000.0, cos_sin_cache: ArrayLike | None = None,
                     style: str = "neox", rotary_dim: int | None = None,
                     check_bounds: bool | None = None,
                     stream: StreamLike = None) -> tuple[ArrayLike, ArrayLike]:
    """Rotate ``q`` and ``k`` in place by the rotary embedding of ``positions`` and write the
    rotated ``k`` and ``v`` into the paged caches at those positions (module docstring).

    Args:
        q: (tokens, nheads, headdim) fp16 / bf16, last dimension contiguous.
        k, v: (tokens, nheads_k, headdim), q's dtype, last dimension contiguous.
        k_cache, v_cache: (num_blocks, block_size, nheads_k, headdim), q's dtype.
        token_tables: (tokens, max_blocks_per_seq) int32, each token's sequence's page row.
        positions: (tokens,) int32 or int64.
        base, cos_sin_cache, style, rotary_dim: as ``rotary_embedding``.
        check_bounds: check positions against the cos / sin cache and the tables on the host
            (a synchronisation); None: when the tables are host memory.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``(q, k)``, the same arrays, rotated in place.

    Raises:
        TypeError: non-arrays, dtypes (q / k / v / caches not one fp16 / bf16 dtype,
            token_tables not int32, positions not int32 / int64), check_bounds not a bool.
        ValueError: what ``rotary_embedding`` and ``paged_kv_append`` raise for their
            arguments (shapes, strides, rotary_dim, style; with checks, positions outside the
            cos / sin cache or without a page).
        NotImplementedError: block_size not a power of two; rotary_dim above 2048.
    """
    result = _ROTARY_KV_APPEND_CALLS.replay(
        (q, k, v, k_cache, v_cache, token_tables, positions, cos_sin_cache),
        (base, style, rotary_dim, check_bounds), stream)
    if result is MISS:
        result = _ROTARY_KV_APPEND_CALLS.record(
            _rotary_kv_append_checked, q, k, v, k_cache, v_cache, token_tables, positions,
            base, cos_sin_cache, style, rotary_dim, check_bounds, stream)
    return result


def _rotary_kv_append_checked(q, k, v, k_cache, v_cache, token_tables, positions, base,
                              cos_sin_cache, style, rotary_dim, check_bounds, stream):
    """The checked path of ``rotary_kv_append`` (validation, planning, launch)."""
    if k is None:
        raise TypeError("k: expected an array (its rows are appended), got None")
    tk = tensor(k, "k", ndim=3, dtypes=HALF_DTYPES)
    tv = tensor(v, "v", ndim=3)
    tkc = tensor(k_cache, "k_cache", ndim=4)
    tvc = tensor(v_cache, "v_cache", ndim=4)
    tt = tensor(token_tables, "token_tables", ndim=2)
    tokens, nheads_k, headdim = tk.shape
    shape("v", tv, tk.shape, "to match k")
    num_blocks, block_size, check_bounds = check_caches(tkc, tvc, nheads_k, headdim, tt,
                                                        check_bounds)
    shape("token_tables", tt, (tokens, None), "to match k's tokens")
    same_dtype("k", tk, v=tv, k_cache=tkc, v_cache=tvc)
    if tt.dtype != "int32":
        raise TypeError(f"token_tables: expected dtype int32, got {tt.dtype}")
    for name, t in (("v", tv), ("token_tables", tt)):   # (q, k: plan_rotary)
        if any(s < 0 for s in t.strides):
            raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    if headdim > 1 and tv.strides[2] != 1:
        raise ValueError(f"v: expected the last dimension to be contiguous (stride 1), got "
                         f"strides {tv.strides}")
    plan = plan_rotary(q, k, positions, base, cos_sin_cache, style, rotary_dim, check_bounds,
                       append_to=(tv, tkc, tvc))
    if plan is None:
        return q, k
    if check_bounds:
        _check_pages(host_ints(tt), host_ints(plan.tp), num_blocks, block_size)
    plan.kernel(plan.tokens, plan.threads,
                plan.args + (kernel_buffer(tv), kernel_buffer(tkc), kernel_buffer(tvc),
                             kernel_buffer(tt), *tv.strides[:2], *tkc.strides[:3],
                             *tvc.strides[:3], *tt.strides, tt.shape[1], num_blocks,
                             block_size.bit_length() - 1, headdim, plan.rotary_dim),
                stream_handle(stream, (plan.tq,)))
    return q, k


def _check_pages(tables, positions, num_blocks, block_size):
    """Host check that every token's position has a page in range (host int arrays)."""
    capacity = tables.shape[1] * block_size
    outside = np.flatnonzero((positions < 0) | (positions >= capacity))
    if outside.size:
        t = int(outside[0])
        raise ValueError(f"positions: expected values in [0, {capacity}) (token_tables' "
                         f"{tables.shape[1]} pages x block_size {block_size}), got "
                         f"positions[{t}] = {int(positions[t])}")
    slots = positions.astype(np.int64) // block_size
    pages = tables[np.arange(tables.shape[0]), slots]
    wrong = np.flatnonzero((pages < 0) | (pages >= num_blocks))
    if wrong.size:
        t = int(wrong[0])
        raise ValueError(f"token_tables: expected page ids in [0, {num_blocks}) at the tokens' "
                         f"positions, got token_tables[{t}, {int(slots[t])}] = "
                         f"{int(pages[t])}")
