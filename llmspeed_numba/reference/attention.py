"""Float64 reference of masked multi-head attention, with its log-sum-exp.

Semantics are FlashAttention 2's:

- Layout ``(batch, seqlen, nheads, headdim)``; ``k`` and ``v`` may have fewer heads (``nheads_k``
  dividing ``nheads``): query head ``h`` reads key/value head ``h // (nheads // nheads_k)``.
- The mask is aligned to the bottom-right corner. With ``offset = seqlen_k - seqlen_q``, query
  ``i`` attends key ``j`` iff ``j >= i + offset - window_left`` (when ``window_left >= 0``) and
  ``j <= i + offset + window_right`` (when ``window_right >= 0``); -1 means unbounded on that
  side. ``causal`` sets ``window_right = 0`` (and keeps ``window_left``).
- ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.
- A query row whose mask is empty has output 0 and log-sum-exp ``-inf``.
- ``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over the attended keys (natural log).

The functions work for any ``seqlen_q``, including one query row (decode):
``attention(q[:, -1:], k, v, causal=True)`` attends every key.

``dtype=`` gives the *plain same-precision* version used to derive test tolerances, computed the
way a straightforward implementation in that precision does (FlashAttention's ``attention_ref``
without upcasting): scaled query, scores, probabilities and output each rounded to ``dtype``,
products accumulated in float32.
"""

import math

import numpy as np


def effective_window(causal, window_size):
    """``(window_left, window_right)`` after applying ``causal`` (FlashAttention 2 rules)."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    return left, right


def attention_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Boolean ``(seqlen_q, seqlen_k)``: True where query ``i`` attends key ``j``."""
    left, right = effective_window(causal, window_size)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)
    allowed = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        allowed &= j >= diagonal - left
    if right >= 0:
        allowed &= j <= diagonal + right
    return allowed


def _round(x, dtype):
    if dtype is None:
        return x
    from .._arrays import numpy_dtype

    return np.asarray(x).astype(numpy_dtype(dtype)).astype(np.float64)


def _round32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _one_sequence(q, k, v, mask, scale, dtype):
    """q (sq, h, d), k / v (sk, hk, d) float64 -> out (sq, h, d), lse (h, sq)."""
    nheads = q.shape[1]
    nheads_k = k.shape[1]
    group = nheads // nheads_k
    kk = np.repeat(k, group, axis=1).transpose(1, 2, 0)       # (h, d, sk)
    vv = np.repeat(v, group, axis=1).transpose(1, 0, 2)       # (h, sk, d)
    qq = q.transpose(1, 0, 2)                                 # (h, sq, d)
    if dtype is None:
        scores = (qq @ kk) * scale
    else:
        scores = _round(_round32(_round(qq * scale, dtype) @ kk), dtype)
    scores = np.where(mask[None], scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True) if scores.shape[-1] else np.full(
        scores.shape[:-1] + (1,), -np.inf)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - safe_max)
    total = weights.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = np.where(total > 0, weights / np.where(total > 0, total, 1.0), 0.0)
        lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1.0))[..., 0]
                       + safe_max[..., 0], -np.inf)
    if dtype is None:
        out = probs @ vv
    else:
        out = _round(_round32(_round(_round32(probs), dtype) @ vv), dtype)
    return out.transpose(1, 0, 2), lse


def _check_heads(q, k, v):
    if q.shape[-1] != k.shape[-1] or k.shape != v.shape or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), dtype=None):
    """Masked attention in float64.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns ``(out, lse)``: out (batch, seqlen_q, nheads, headdim) float64 and
    lse (batch, nheads, seqlen_q) float64. ``dtype`` ("float16" / "bfloat16"): the plain
    same-precision computation instead (see the module docstring).
    """
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    _check_heads(q, k, v)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    mask = attention_mask(seqlen_q, seqlen_k, causal, window_size)
    out = np.zeros((batch, seqlen_q, nheads, headdim))
    lse = np.zeros((batch, nheads, seqlen_q))
    for b in range(batch):
        out[b], lse[b] = _one_sequence(q[b], k[b], v[b], mask, scale, dtype)
    return out, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), dtype=None):
    """Masked attention over a packed batch of sequences of different lengths, in float64.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); sequence ``b`` is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and likewise for k, v), each masked on its own.
    Returns ``(out, lse)``: out (total_q, nheads, headdim), lse (nheads, total_q); rows of q
    outside every sequence are 0 / -inf.
    """
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    _check_heads(q, k, v)
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k)]
    headdim = q.shape[-1]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        mask = attention_mask(q1 - q0, k1 - k0, causal, window_size)
        out[q0:q1], lse[:, q0:q1] = _one_sequence(q[q0:q1], k[k0:k1], v[k0:k1], mask, scale,
                                                  dtype)
    return out, lse
