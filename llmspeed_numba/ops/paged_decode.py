"""Decode attention over a paged KV cache (flash-decoding with split-K), on Tensor Cores.

    out[b, t, h, :] = sum_j P[b, h, t, j] v(b, j, h // group)
    P[b, h, t, j]   = exp(scale * q[b, t, h] . k(b, j, h // group) - lse[b, h, t])   (attended j)
    k(b, j, hk)     = k_cache[block_table[b, j // block_size], j % block_size, hk, :]   (v alike)

Layout: ``k_cache``, ``v_cache`` (num_blocks, block_size, nheads_k, headdim); ``block_table`` int32
(batch, max_blocks_per_seq); ``seq_lens`` int32 (batch,); q (batch, nheads, headdim) or
(batch, q_len, nheads, headdim); ``group = nheads // nheads_k`` (GQA / MQA).

Mask: ``seq_lens[b]`` *includes* the ``q_len`` new tokens (already appended, as in vLLM and
FlashInfer). Query ``t`` (0-based among the new ones) sits at position ``p = seq_len - q_len + t``
and attends cache positions ``j`` with ``p - window_left <= j <= p`` (bottom-right causal; no
lower bound when ``window_left == -1``), i.e. FlashAttention 2's ``causal=True`` with
``seqlen_k = seq_len``. A query with nothing to attend (``seq_len == 0``) gets 0 and lse ``-inf``.

Kernel (``_paged_decode_kernel.py``): one block per (batch, kv head, split, row tile); the query
rows that share a KV head are the rows of one Tensor Core tile, so each K/V page is read once per
GQA group; keys stream through per-warp rings of ``cp.async`` copies; with several splits of a
sequence, the last block to finish merges their partials (flash-decoding with the merge folded
into the kernel). Plan (``_paged_decode_plan.py``): the block configuration and the split count
(``num_splits=None``), from the shapes alone (no device-to-host read): the longest possible
sequence is ``max_blocks_per_seq * block_size``, so pass a trimmed block_table
(``PagedKVCache.tables`` does) whose width tracks the real lengths. Repeated call signatures
replay through ``_replay``; split partials and tickets are ``_workspace`` workspaces (their
own for each call captured into a CUDA graph).

Bounds (``check_bounds``): the kernel is memory-safe for any block_table / seq_lens contents
(lengths are clamped to ``[0, max_blocks_per_seq * block_size]``, page ids to
``[0, num_blocks)``), but invalid contents give meaningless results. ``check_bounds=True`` reads
block_table and seq_lens back to the host (a device synchronisation) and raises ``ValueError`` for
a length outside ``[0, max_blocks_per_seq * block_size]`` or a used page id outside
``[0, num_blocks)``. Default (``None``): checked when the arrays are host memory (the CUDA
simulator), unchecked on the GPU.

Tests and benchmark sweeps force a configuration through ``TUNING`` (scope ``paged_decode`` of
``_overrides.overrides``): ``tuning``, ``(warps, stages, q_smem[, l2_prefetch])``.
"""

import numpy as np

from .. import _checks
from .._arrays import empty, host_ints, kernel_buffer, stream_handle
from .._checks import boolean, output, same_dtype, shape, tensor
from .._env import SIMULATOR
from .._launch import programmatic_launch
from .._overrides import Knobs
from .._typing import ArrayLike, StreamLike
from .._replay import MISS, OpCalls
from .._workspace import unused, workspace
from ._attention_common import LOG2E
from ._paged_decode_kernel import DecodeArgs, _decode_kernel
from ._paged_decode_layout import shared_bytes
from ._paged_decode_plan import MAX_SPLITS, launch_plan

HALF_DTYPES = ("float16", "bfloat16")
HEADDIMS = (16, 32, 64, 128, 256)
BLOCK_SIZES = tuple(1 << s for s in range(3, 9))  # 8 .. 256

#: ``tuning``: ``(warps, stages, q_smem[, l2_prefetch])`` forced (None: planned).
TUNING = Knobs("paged_decode", tuning=None)

#: A split launch's workspaces (``_workspace``, their own under CUDA-graph capture: a captured
#: call shares partials and tickets with no other graph or eager call, and each replay starts
#: from zero tickets): partial outputs, partial log2-sum-exps, tickets.
_WORK = (("paged_decode_part_o", np.float32), ("paged_decode_part_lse", np.float32),
         ("paged_decode_tickets", np.int32))


# ---- checks ---------------------------------------------------------------------------------

def _check_options(softmax_scale, window_size, headdim, num_splits):
    scale = _checks.softmax_scale(softmax_scale, headdim)
    left, right = _checks.window_size(window_size)
    if right > 0:
        raise NotImplementedError(
            f"window_size[1]: decode attention is causal among the new tokens (bottom-right "
            f"aligned); expected -1 or 0, got {right}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
            raise TypeError(f"num_splits: expected an int or None, got "
                            f"{type(num_splits).__name__}")
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits: expected 1 <= num_splits <= {MAX_SPLITS}, got "
                             f"{num_splits}")
    return scale, int(left)


def _check_cache_layout(name, t):
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    if t.strides[3] != 1:
        raise ValueError(f"{name}: expected the last dimension to be contiguous (stride 1), got "
                         f"strides {t.strides}")
    if t.ptr % 16 or any(s % 8 for n, s in zip(t.shape[:3], t.strides[:3], strict=True) if n > 1):
        raise ValueError(f"{name}: expected a 16-byte aligned pointer and strides that are "
                         f"multiples of 8 elements (16-byte rows for cp.async), got strides "
                         f"{t.strides}")


def check_tables(block_table, seq_lens, num_blocks, block_size, q_len=None):
    """Host check of block_table / seq_lens contents (both host int arrays); ``ValueError``."""
    capacity = block_table.shape[1] * block_size
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > capacity))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"seq_lens: expected lengths in [0, {capacity}] (max_blocks_per_seq "
                         f"{block_table.shape[1]} x block_size {block_size}), got "
                         f"seq_lens[{b}] = {int(seq_lens[b])}")
    for b, n in enumerate(seq_lens):
        used = block_table[b, :-(-int(n) // block_size)]
        wrong = np.flatnonzero((used < 0) | (used >= num_blocks))
        if wrong.size:
            j = int(wrong[0])
            raise ValueError(f"block_table: expected page ids in [0, {num_blocks}) for the "
                             f"{used.size} pages sequence {b} uses, got block_table[{b}, {j}] = "
                             f"{int(used[j])}")


def _validate(q, k_cache, v_cache, block_table, seq_lens):
    tq = tensor(q, "q", ndim=(3, 4), dtypes=HALF_DTYPES)
    tk = tensor(k_cache, "k_cache", ndim=4)
    tv = tensor(v_cache, "v_cache", ndim=4)
    tbt = tensor(block_table, "block_table", ndim=2)
    tsl = tensor(seq_lens, "seq_lens", ndim=1)
    batch = tq.shape[0]
    nheads, headdim = tq.shape[-2], tq.shape[-1]
    num_blocks, block_size, nheads_k, _ = tk.shape
    shape("k_cache", tk, (None, None, None, headdim), "to match q's headdim")
    shape("v_cache", tv, tk.shape, "to match k_cache")
    shape("block_table", tbt, (batch, None), "to match q's batch")
    shape("seq_lens", tsl, (batch,), "to match q's batch")
    same_dtype("q", tq, k_cache=tk, v_cache=tv)
    for name, t in (("block_table", tbt), ("seq_lens", tsl)):
        if t.dtype != "int32":
            raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    if tq.ndim == 4 and tq.shape[1] == 0:
        raise ValueError(f"q: expected at least one query token, got shape {tq.shape}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"k_cache: expected nheads_k dividing q's nheads {nheads}, got "
                         f"{nheads_k}")
    if num_blocks == 0 or tbt.shape[1] == 0:
        raise ValueError(f"k_cache / block_table: expected at least one page, got "
                         f"{num_blocks} pages and {tbt.shape[1]} slots a sequence")
    for name, t in (("q", tq), ("block_table", tbt), ("seq_lens", tsl)):
        if any(s < 0 for s in t.strides):
            raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    _check_cache_layout("k_cache", tk)
    _check_cache_layout("v_cache", tv)
    if headdim not in HEADDIMS:
        raise NotImplementedError(f"q: headdim {headdim} is not supported; expected one of "
                                  f"{HEADDIMS}")
    if block_size not in BLOCK_SIZES:
        raise NotImplementedError(f"k_cache: block_size {block_size} is not supported; "
                                  f"expected a power of two in [8, 256]")
    return tq, tk, tv, tbt, tsl



_PAGED_DECODE_ATTENTION_CALLS = OpCalls("paged_decode_attention")


def paged_decode_attention(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                           block_table: ArrayLike, seq_lens: ArrayLike, *,
                           softmax_scale: float | None = None,
                           window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                           out: ArrayLike | None = None, stream: StreamLike = None,
                           num_splits: int | None = None, check_bounds: bool | None = None
                           ) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """Attention of the newest tokens of each sequence over its paged KV cache.

    q: (batch, nheads, headdim), or (batch, q_len, nheads, headdim) for ``q_len`` new tokens
    (speculative decoding), fp16 or bf16. k_cache, v_cache: (num_blocks, block_size, nheads_k,
    headdim), q's dtype, ``nheads_k`` dividing ``nheads``, ``block_size`` a power of two in
    [8, 256], ``headdim`` in (16, 32, 64, 128, 256), rows contiguous and 16-byte aligned.
    block_table: int32 (batch, max_blocks_per_seq), page ids of each sequence in order.
    seq_lens: int32 (batch,), each sequence's length *including* the q_len new tokens, which
    must already be in the cache (``paged_kv_append``).

    Query ``t`` sits at position ``seq_len - q_len + t`` and attends the positions up to it
    (bottom-right causal), and no further back than ``window_size[0]`` positions (-1: no limit);
    ``window_size[1]`` must be -1 or 0 (both: causal). ``softmax_scale`` defaults to
    ``1 / sqrt(headdim)``.

    Returns ``out`` shaped like q (q's dtype, in q's array kind), and with ``return_lse`` also
    ``lse`` float32 (batch, nheads) for 3-D q or (batch, nheads, q_len) for 4-D q (natural log;
    ``-inf`` for a query with nothing to attend). ``num_splits``: split-K count (None: chosen
    from the shapes, see ``_paged_decode_plan``). ``check_bounds``: see the module docstring.

    Errors: ``TypeError`` (not an array, dtype, options of the wrong type), ``ValueError``
    (shapes, strides, alignment, option values; with checks on, seq_lens / block_table
    contents), ``NotImplementedError`` (headdim, block_size, window_size[1] > 0).
    """
    result = _PAGED_DECODE_ATTENTION_CALLS.replay(
        (q, k_cache, v_cache, block_table, seq_lens, out),
        (softmax_scale, window_size, return_lse, num_splits, check_bounds), stream)
    if result is MISS:
        result = _PAGED_DECODE_ATTENTION_CALLS.record(
            _paged_decode_attention_checked, q, k_cache, v_cache, block_table, seq_lens,
            softmax_scale, window_size, return_lse, out, stream, num_splits, check_bounds)
    return result


def _paged_decode_attention_checked(q, k_cache, v_cache, block_table, seq_lens, softmax_scale,
                                    window_size, return_lse, out, stream, num_splits,
                                    check_bounds):
    """The checked path of ``paged_decode_attention`` (validation, planning, launch)."""
    tq, tk, tv, tbt, tsl = _validate(q, k_cache, v_cache, block_table, seq_lens)
    batch = tq.shape[0]
    nheads, headdim = tq.shape[-2], tq.shape[-1]
    num_blocks, block_size, nheads_k, _ = tk.shape
    q_len = tq.shape[1] if tq.ndim == 4 else 1
    scale, left = _check_options(softmax_scale, window_size, headdim, num_splits)
    boolean("return_lse", return_lse)
    if check_bounds is not None:
        boolean("check_bounds", check_bounds)
    lse_shape = (batch, nheads, q_len) if tq.ndim == 4 else (batch, nheads)
    to = output("out", out, tq.shape, tq.dtype, tq)
    if to is None:
        out = empty(tq, tq.shape, tq.dtype)
        to = tensor(out, "out")
    lse = None
    if return_lse:
        lse = empty(tq, lse_shape, "float32")
        tl = tensor(lse, "lse")
    if check_bounds is None:
        check_bounds = SIMULATOR or tbt.kind == "numpy"
    if check_bounds:
        check_tables(host_ints(tbt), host_ints(tsl), num_blocks, block_size)
    if batch == 0 or nheads == 0:
        return (out, lse) if return_lse else out

    tuning = TUNING.tuning
    plan = launch_plan(batch, q_len, nheads, nheads_k, headdim, block_size, tbt.shape[1],
                       tq.dtype, None if num_splits is None else int(num_splits),
                       None if tuning is None else tuple(tuning))
    config, num_splits = plan["config"], plan["num_splits"]
    warps, stages, q_smem = config[4:7]
    group, rows_total, row_tiles = plan["group"], plan["rows_total"], plan["row_tiles"]
    blocks, max_slots = plan["blocks"], tbt.shape[1]

    # strides, with q (and out, lse) seen as 4-D / 3-D
    if tq.ndim == 4:
        sqb, sqt, sqh, sqd = tq.strides
        sob, sot, soh, sod = to.strides
    else:
        (sqb, sqh, sqd), sqt = tq.strides, 0
        (sob, soh, sod), sot = to.strides, 0
    slb = slh = slt = 0
    if return_lse:
        if tq.ndim == 4:
            slb, slh, slt = tl.strides
        else:
            slb, slh = tl.strides
    handle = stream_handle(stream, (tq, tk))
    split = num_splits > 1
    rows = batch * q_len * nheads
    work = (rows * num_splits * headdim, rows * num_splits, blocks)
    if split:
        po, pl, tickets = (workspace(tq, handle, name, n, dtype, own_in_graph=True)
                           for (name, dtype), n in zip(_WORK, work, strict=True))
    else:
        po = pl = unused(tq, np.float32)
        tickets = unused(tq, np.int32)
    lse_buf = kernel_buffer(tl) if return_lse else unused(tq, np.float32)
    kernel = _decode_kernel(*config, trigger=programmatic_launch())
    sk, sv = tk.strides, tv.strides
    args = DecodeArgs(
        q=kernel_buffer(tq), kc=kernel_buffer(tk), vc=kernel_buffer(tv), bt=kernel_buffer(tbt),
        sl=kernel_buffer(tsl), out=kernel_buffer(to), lse=lse_buf, part_o=po, part_lse=pl,
        tickets=tickets, sqb=sqb, sqt=sqt, sqh=sqh, sqd=sqd, skb=sk[0], skt=sk[1], skh=sk[2],
        svb=sv[0], svt=sv[1], svh=sv[2], sbtb=tbt.strides[0], sbts=tbt.strides[1],
        ssl=tsl.strides[0], sob=sob, sot=sot, soh=soh, sod=sod, slb=slb, slh=slh, slt=slt,
        q_len=q_len, nheads=nheads, nheads_k=nheads_k, group=group, rows_total=rows_total,
        row_tiles=row_tiles, max_slots=max_slots, num_blocks=num_blocks,
        bs_shift=block_size.bit_length() - 1, window_left=left, num_splits=num_splits,
        scale_log2=scale * LOG2E, want_lse=int(return_lse))
    kernel(blocks * num_splits, 32 * warps, args, handle,
           shared_bytes(headdim, warps, stages, q_smem))
    return (out, lse) if return_lse else out
