"""Float64 references of attention over a paged KV cache: decode, prefill chunks, the append.

The paged cache is gathered into one contiguous K/V per sequence and handed to the FlashAttention
reference (``reference.attention``) with ``causal=True``: the mask is bottom-right aligned, so
with ``seq_len = seq_lens[b]`` (which *includes* the ``q_len`` new tokens) query ``t`` attends
cache positions ``j`` with

    max(0, seq_len - q_len + t - window_left) <= j <= seq_len - q_len + t

(no lower bound when ``window_left == -1``). A query with no attended position (``seq_len = 0``,
or ``seq_len < q_len`` for the early queries) has output 0 and lse ``-inf``.
"""

import math

import numpy as np

from .attention import _check_heads, _one_sequence, attention, attention_mask


def gather_kv(k_cache, v_cache, block_table, seq_lens):
    """Contiguous float64 ``(k, v)`` of every sequence: lists of ``(seq_len, nheads_k, headdim)``
    arrays, read from the pages ``block_table[b, :ceil(seq_len / block_size)]``."""
    k_cache = np.asarray(k_cache).astype(np.float64)
    v_cache = np.asarray(v_cache).astype(np.float64)
    block_table = np.asarray(block_table)
    block_size = k_cache.shape[1]
    ks, vs = [], []
    for b, n in enumerate(np.asarray(seq_lens)):
        n = int(n)
        pages = block_table[b, :-(-n // block_size)]
        ks.append(k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n])
        vs.append(v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n])
    return ks, vs


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None,
                           window_size=(-1, -1), dtype=None):
    """Decode attention over a paged KV cache, in float64.

    q: (batch, nheads, headdim) or (batch, q_len, nheads, headdim); caches (num_blocks,
    block_size, nheads_k, headdim); block_table (batch, max_blocks_per_seq); seq_lens (batch,).
    Returns ``(out, lse)``: out shaped like q, lse (batch, nheads) or (batch, nheads, q_len)
    (natural log). ``dtype``: the plain same-precision computation (see ``reference.attention``).
    """
    q = np.asarray(q).astype(np.float64)
    squeeze = q.ndim == 3
    if squeeze:
        q = q[:, None]
    ks, vs = gather_kv(k_cache, v_cache, block_table, seq_lens)
    out = np.zeros(q.shape)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    for b in range(q.shape[0]):
        o, log_sum = attention(q[b:b + 1], ks[b][None], vs[b][None], causal=True,
                               softmax_scale=softmax_scale, window_size=window_size, dtype=dtype)
        out[b], lse[b] = o[0], log_sum[0]
    if squeeze:
        return out[:, 0], lse[:, :, 0]
    return out, lse


def paged_kv_append(k, v, k_cache, v_cache, block_table, seq_lens):
    """Host copies of the caches with ``k``/``v`` (batch, new_tokens, nheads_k, headdim) written
    at positions ``seq_lens[b] .. seq_lens[b] + new_tokens - 1`` of each sequence."""
    k_out = np.array(k_cache, copy=True)
    v_out = np.array(v_cache, copy=True)
    block_size = k_out.shape[1]
    k, v = np.asarray(k), np.asarray(v)
    for b, start in enumerate(np.asarray(seq_lens)):
        for t in range(k.shape[1]):
            pos = int(start) + t
            page = int(np.asarray(block_table)[b, pos // block_size])
            k_out[page, pos % block_size] = k[b, t]
            v_out[page, pos % block_size] = v[b, t]
    return k_out, v_out


def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, *,
                            causal=True, softmax_scale=None, window_size=(-1, -1), dtype=None):
    """Prefill attention over a paged KV cache, in float64.

    q: (total_q, nheads, headdim), sequence ``b``'s new tokens in rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; caches (num_blocks, block_size, nheads_k, headdim);
    block_table (batch, max_blocks_per_seq); seq_lens (batch,), each sequence's length including
    its new tokens. The sequence's keys are gathered from its pages
    (``gather_kv``) and masked as ``attention`` does with
    ``seqlen_k = seq_lens[b]`` (bottom-right aligned: query ``t`` sits at position
    ``seq_lens[b] - q_len + t``). Returns ``(out, lse)``: out (total_q, nheads, headdim), lse
    (nheads, total_q); rows outside every sequence are 0 / -inf.
    """
    q = np.asarray(q).astype(np.float64)
    ks, vs = gather_kv(k_cache, v_cache, block_table, seq_lens)
    _check_heads(q, ks[0] if ks else q, vs[0] if vs else q)
    cu = [int(x) for x in np.asarray(cu_seqlens_q)]
    headdim = q.shape[-1]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        mask = attention_mask(q1 - q0, ks[b].shape[0], causal, window_size)
        out[q0:q1], lse[:, q0:q1] = _one_sequence(q[q0:q1], ks[b], vs[b], mask, scale, dtype)
    return out, lse
