"""Prefill attention over a paged KV cache: a chunk of new queries of each sequence attends the
sequence's keys and values in the cache (its earlier tokens and the chunk itself).

    out[i, h, :] = sum_j P[h, i, j] v(b, j, h // group)          (i a row of sequence b)
    P[h, i, j]   = exp(scale * q[i, h] . k(b, j, h // group) - lse[h, i])   (attended j)
    k(b, j, hk)  = k_cache[block_table[b, j // block_size], j % block_size, hk, :]   (v alike)

Layout: q ``(total_q, nheads, headdim)``, the new tokens of every sequence packed, sequence ``b``
being rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (``q_len_b`` of them); ``k_cache``,
``v_cache`` ``(num_blocks, block_size, nheads_k, headdim)`` with int32 ``block_table``
``(batch, max_blocks_per_seq)`` and int32 ``seq_lens`` ``(batch,)``, as ``paged_decode_attention``
takes them; ``group = nheads // nheads_k`` (GQA / MQA). FlashInfer and vLLM call this "prefill
with a paged KV cache"; the engine uses it for chunked prefill.

Mask: ``seq_lens[b]`` *includes* the new tokens (already appended with ``paged_kv_append``).
Query ``t`` of sequence ``b`` sits at position ``p = seq_lens[b] - q_len_b + t`` and, with
``causal``, attends positions ``j <= p`` (FlashAttention 2's bottom-right aligned mask with
``seqlen_k = seq_lens[b]``), and with a window ``p - window_left <= j <= p + window_right``. A
query with nothing to attend gets output 0 and lse ``-inf``. ``q_len_b = seq_lens[b]`` (no
earlier tokens) is ordinary causal prefill; ``q_len_b = 1`` is a decode step.

Kernel: the Tensor Core FlashAttention-2 kernel of ``_flash_attn_tc.py`` (mma.sync m16n8k16,
cp.async, ldmatrix, online softmax in registers; see that module), in its ``paged`` variant: a
block owns ``warps * 16 * m_tiles`` query rows of one (sequence, head) and streams key tiles of
``block_n`` keys from the last to the first, skipping those wholly outside the causal mask /
window. A key tile's rows are gathered through the block table: each thread loads the page ids
of its 16-byte chunks (key ``col0 + r`` -> page ``block_table[b, (col0 + r) >> log2(block_size)]``,
slot ``(col0 + r) & (block_size - 1)``) and then issues their cp.async copies, so any power-of-two
``block_size`` works, including pages shorter than a tile. Tiles: ``flash_attn.TC_CONFIGS``
(headdim 64: 4 warps x 2 m16 tiles = 128 rows, 64 keys; 128: 4 warps x 1 m16 tile = 64 rows,
64 keys), uncapped registers as the varlen kernel.

Bounds (``check_bounds``): the kernel is memory-safe for any cu_seqlens_q / block_table /
seq_lens contents (query offsets are clamped to ``[0, total_q]``, lengths to ``[0,
max_blocks_per_seq * block_size]``, page ids to ``[0, num_blocks)``), but invalid contents give
meaningless results, and rows of a sequence longer than ``max_seqlen_q`` are not written.
``check_bounds=True`` reads the three arrays back to the host (a device synchronisation) and
raises ``ValueError`` for decreasing or out-of-range offsets, a sequence longer than
``max_seqlen_q``, a length outside ``[0, max_blocks_per_seq * block_size]`` or a used page id
outside ``[0, num_blocks)``. Default (``None``): checked when the arrays are host memory (the
CUDA simulator), unchecked on the GPU (no synchronisation).

Tests force a tile configuration through ``TUNING`` (scope ``paged_prefill`` of
``_overrides.overrides``): ``config``, a ``flash_attn.TC_CONFIGS`` tuple.
"""

import numpy as np

from .. import compile_check
from .._arrays import empty, host_ints, kernel_buffer, stream_handle
from .._checks import (aligned, boolean, contiguous, last_dim_contiguous, non_negative_strides,
                       output, same_dtype, shape, tensor)
from .._env import SIMULATOR
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from ._attention_common import LOG2E
from . import _flash_attn_tc
from .flash_attn import (_SIGNATURE, MAX_HEADDIM, SIMULATOR_TC_CONFIG, _check_cu_seqlens,
                         _check_max_seqlen, _check_options, _normalise_window,
                         _prefer_shared_memory, lse_output, padded_dim, tc_config)
from .paged_decode import _check_cache_layout, check_tables

HALF_DTYPES = ("float16", "bfloat16")

_GRID_YZ_LIMIT = 65535
_INT32_MAX = 2**31 - 1

#: ``config``: the tile configuration forced (None: ``flash_attn.tc_config``).
TUNING = Knobs("paged_prefill", config=None)


# ---- validation ---------------------------------------------------------------------------

def _validate(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens):
    tq = tensor(q, "q", ndim=3, dtypes=HALF_DTYPES)
    tk = tensor(k_cache, "k_cache", ndim=4)
    tv = tensor(v_cache, "v_cache", ndim=4)
    tbt = tensor(block_table, "block_table", ndim=2)
    tcq = tensor(cu_seqlens_q, "cu_seqlens_q", ndim=1)
    tsl = tensor(seq_lens, "seq_lens", ndim=1)
    total_q, nheads, headdim = tq.shape
    num_blocks, block_size, nheads_k, _ = tk.shape
    batch = tbt.shape[0]
    shape("k_cache", tk, (None, None, None, headdim), "to match q's headdim")
    shape("v_cache", tv, tk.shape, "to match k_cache")
    shape("seq_lens", tsl, (batch,), "to match block_table's batch")
    shape("cu_seqlens_q", tcq, (batch + 1,), "(batch + 1) to match block_table's batch")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"k_cache: expected nheads_k dividing q's nheads {nheads}, got "
                         f"{nheads_k}")
    if num_blocks == 0 or tbt.shape[1] == 0:
        raise ValueError(f"k_cache / block_table: expected at least one page, got "
                         f"{num_blocks} pages and {tbt.shape[1]} slots a sequence")
    same_dtype("q", tq, k_cache=tk, v_cache=tv)
    for name, t in (("block_table", tbt), ("cu_seqlens_q", tcq), ("seq_lens", tsl)):
        if t.dtype != "int32":
            raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    if tq.size:
        non_negative_strides("q", tq)
        last_dim_contiguous("q", tq)
        if not aligned("q", tq, 8):
            raise ValueError(f"q: expected a 16-byte aligned pointer and strides that are "
                             f"multiples of 8 elements (cp.async rows), got strides {tq.strides}")
    _check_cache_layout("k_cache", tk)
    _check_cache_layout("v_cache", tv)
    non_negative_strides("block_table", tbt)
    contiguous("cu_seqlens_q", tcq)
    if tsl.size:                 # numpy gives an empty array stride 0
        contiguous("seq_lens", tsl)
    if headdim % 8 or not 8 <= headdim <= MAX_HEADDIM:
        raise NotImplementedError(f"q: headdim {headdim} is not supported; expected a multiple "
                                  f"of 8 in [8, {MAX_HEADDIM}]")
    if block_size & (block_size - 1):
        raise NotImplementedError(f"k_cache: block_size {block_size} is not supported; "
                                  f"expected a power of two")
    if tbt.shape[1] * block_size > _INT32_MAX or total_q > _INT32_MAX:
        raise NotImplementedError(f"block_table / q: at most {_INT32_MAX} keys a sequence and "
                                  f"query rows, got {tbt.shape[1] * block_size} and {total_q}")
    return tq, tk, tv, tbt, tcq, tsl


def _output(out, tq):
    to = output("out", out, tq.shape, tq.dtype, tq)
    if to is None:
        out = empty(tq, tq.shape, tq.dtype)
        to = tensor(out, "out")
    elif to.size:
        last_dim_contiguous("out", to)
        if not aligned("out", to, 8):
            raise ValueError(f"out: expected a 16-byte aligned pointer and strides that are "
                             f"multiples of 8 elements (16-byte stores), got strides "
                             f"{to.strides}")
    return out, to


# ---- public API ---------------------------------------------------------------------------

_PAGED_PREFILL_ATTENTION_CALLS = OpCalls("paged_prefill_attention")


def paged_prefill_attention(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                            block_table: ArrayLike, cu_seqlens_q: ArrayLike,
                            seq_lens: ArrayLike, max_seqlen_q: int, *, causal: bool = True,
                            softmax_scale: float | None = None,
                            window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                            out: ArrayLike | None = None, stream: StreamLike = None,
                            check_bounds: bool | None = None
                            ) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """Attention of chunks of new tokens over their sequences' paged KV cache.

    q: (total_q, nheads, headdim) fp16 or bf16, sequence ``b``'s new tokens in rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; headdim a multiple of 8 up to 256; last dimension
    contiguous, pointer and strides 16-byte aligned (q sliced out of a packed qkv works).
    k_cache, v_cache: (num_blocks, block_size, nheads_k, headdim), q's dtype, ``nheads_k``
    dividing ``nheads``, ``block_size`` a power of two, rows contiguous and 16-byte aligned.
    block_table: int32 (batch, max_blocks_per_seq), page ids of each sequence in order.
    cu_seqlens_q: int32 (batch + 1,), contiguous, non-decreasing. seq_lens: int32 (batch,),
    contiguous: each sequence's length *including* its new tokens, which must already be in the
    cache (``paged_kv_append``). max_seqlen_q: at least the longest chunk (sets the grid).

    Query ``t`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + t``; ``causal``
    (default) lets it attend the positions up to it (bottom-right aligned, as FlashAttention 2
    with ``seqlen_k = seq_lens[b]``). window_size=(left, right): sliding window, -1 unbounded;
    with causal, right is 0. softmax_scale defaults to ``1 / sqrt(headdim)``.

    Returns out (total_q, nheads, headdim) in q's dtype and kind (or ``out=``; rows outside
    every sequence are not written), and with ``return_lse=True`` also lse (nheads, total_q)
    float32 (natural log; ``-inf`` for a query with nothing to attend, whose output is 0).
    ``check_bounds``: see the module docstring.

    Errors: ``TypeError`` (not an array, dtypes, options of the wrong type), ``ValueError``
    (ranks, shapes that disagree, strides, alignment, option values; with checks on, the
    contents of cu_seqlens_q / seq_lens / block_table), ``NotImplementedError`` (headdim,
    block_size, sizes past int32, more than 65535 heads or sequences).
    """
    result = _PAGED_PREFILL_ATTENTION_CALLS.replay(
        (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out),
        (max_seqlen_q, causal, softmax_scale, window_size, return_lse, check_bounds), stream)
    if result is MISS:
        result = _PAGED_PREFILL_ATTENTION_CALLS.record(
            _paged_prefill_attention_checked, q, k_cache, v_cache, block_table, cu_seqlens_q,
            seq_lens, max_seqlen_q, causal, softmax_scale, window_size, return_lse, out, stream,
            check_bounds)
    return result


def _paged_prefill_attention_checked(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                                     max_seqlen_q, causal, softmax_scale, window_size, return_lse,
                                     out, stream, check_bounds):
    """The checked path of ``paged_prefill_attention`` (validation, planning, launch)."""
    tq, tk, tv, tbt, tcq, tsl = _validate(q, k_cache, v_cache, block_table, cu_seqlens_q,
                                          seq_lens)
    total_q, nheads, headdim = tq.shape
    num_blocks, block_size, nheads_k, _ = tk.shape
    batch, max_slots = tbt.shape
    capacity = max_slots * block_size
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    scale, left, right = _check_options(causal, softmax_scale, window_size, headdim, return_lse)
    if check_bounds is not None:
        boolean("check_bounds", check_bounds)
    out, to = _output(out, tq)
    lse, lse_buf = lse_output(tq, (nheads, total_q), return_lse, stream)
    if check_bounds is None:
        check_bounds = SIMULATOR or tbt.kind == "numpy"
    if check_bounds:
        _check_cu_seqlens("cu_seqlens_q", tcq, total_q, max_seqlen_q, "max_seqlen_q")
        check_tables(host_ints(tbt), host_ints(tsl), num_blocks, block_size)
    if batch and max_seqlen_q and nheads and total_q:
        if nheads > _GRID_YZ_LIMIT or batch > _GRID_YZ_LIMIT:
            raise NotImplementedError(f"q: at most {_GRID_YZ_LIMIT} heads and sequences, got "
                                      f"{nheads} heads, {batch} sequences")
        left, right = _normalise_window(causal, left, right, max_seqlen_q, capacity)
        _launch(tq, tk, tv, to, lse_buf, tbt, tcq, tsl, max_seqlen_q=max_seqlen_q,
                group=nheads // nheads_k, scale=scale, left=left, right=right, stream=stream)
    return (out, lse) if return_lse else out


# ---- launch -------------------------------------------------------------------------------

def _kernel_config(headdim, config):
    """``(warps, m_tiles, block_n)`` and the kernel of ``config`` (None: the default one)."""
    config = tuple(config or (SIMULATOR_TC_CONFIG if SIMULATOR else tc_config(headdim)))
    warps, m_tiles, block_n = config[:3]
    return warps, m_tiles, block_n


def _launch(tq, tk, tv, to, lse_buf, tbt, tcq, tsl, *, max_seqlen_q, group, scale, left, right,
            stream):
    total_q, nheads, headdim = tq.shape
    num_blocks, block_size = tk.shape[:2]
    batch, max_slots = tbt.shape
    warps, m_tiles, block_n = _kernel_config(headdim, TUNING.config)
    dim = padded_dim(headdim)
    kernel = _flash_attn_tc.tc_kernel(_SIGNATURE, headdim, dim, warps, m_tiles, block_n, 0,
                                      tq.dtype == "bfloat16", True, True)
    block_m = warps * 16 * m_tiles
    grid = (-(-max_seqlen_q // block_m), nheads, batch)
    args = (kernel_buffer(tq), kernel_buffer(tk), kernel_buffer(tv), kernel_buffer(to),
            lse_buf, kernel_buffer(tcq), kernel_buffer(tsl), kernel_buffer(tbt),
            total_q, max_slots * block_size,
            0, *tq.strides[:2], *tk.strides[:3], *tv.strides[:3], 0, *to.strides[:2],
            0, total_q, *tbt.strides,
            group, np.float32(scale), np.float32(scale * LOG2E), left, right,
            num_blocks, block_size.bit_length() - 1)
    if not SIMULATOR:
        _prefer_shared_memory(kernel)
    kernel(grid, 32 * warps, args, stream_handle(stream, (tq, tk, tv)),
           _flash_attn_tc.tc_shared_bytes(dim, warps, m_tiles, block_n))


# ---- compile-only check (sm_90a SASS: HMMA / LDSM / LDGSTS, no local memory) --------------

def _compile_target(headdim, is_bf16):
    """The kernel exactly as launched (the configuration of ``tc_config``, no launch bounds)."""
    def build():
        warps, m_tiles, block_n = _kernel_config(headdim, tc_config(headdim))
        fn = _flash_attn_tc._tc_kernel_fn(headdim, padded_dim(headdim), warps, m_tiles, block_n,
                                          is_bf16, True, 0, True)
        return fn, _SIGNATURE

    return build


for _headdim in (64, 128):
    compile_check.register(
        f"paged_prefill_d{_headdim}_bf16", _compile_target(_headdim, True),
        ptx_must_have=("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4",
                       "ldmatrix.sync.aligned.m8n8.x4.trans", "cp.async.cg.shared.global",
                       "ex2.approx"),
        sass_must_have=("HMMA", "LDSM", "LDGSTS", "MUFU.EX2"))
