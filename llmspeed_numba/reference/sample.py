"""Float64 NumPy references of ``llmspeed_numba.sample``: the exact distribution a row's token is
drawn from, and torch's (vLLM's fallback) sort-based filtering as a second reference.

Semantics (the op's docstring): temperature 0 is the argmax; otherwise p = softmax(x / T);
top_k keeps every logit >= the k-th largest; top_p (on the top-k-renormalised distribution) keeps
the tokens whose strictly larger tokens hold less than top_p of the mass; min_p keeps
p >= min_p * max p; the kept set is renormalised.
"""

import numpy as np


def _f64(x):
    return np.asarray(x).astype(np.float64)


def kept(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Boolean mask of the tokens of one row the filters keep (temperature > 0)."""
    x = _f64(logits_row)
    vocab = x.size
    p = np.exp((x - x.max()) / temperature)
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        values = np.unique(x[keep])[::-1]                # distinct kept logits, descending
        mass = np.array([q[x == v].sum() for v in values])
        above = np.concatenate([[0.0], np.cumsum(mass)[:-1]])  # mass strictly above each value
        threshold = values[above < top_p].min()
        keep &= x >= threshold
    if min_p > 0:
        keep &= p >= min_p * p.max()
    return keep


def probabilities(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """(rows, vocab) float64: the distribution each row's token is drawn from (a one-hot argmax
    row at temperature 0). Scalar parameters apply to every row; sequences give one a row."""
    x = _f64(logits)
    rows, vocab = x.shape
    out = np.zeros((rows, vocab))

    def at(v, r):
        return np.asarray(v).reshape(-1)[r] if np.ndim(v) else v

    for r in range(rows):
        t = float(at(temperature, r))
        if t == 0:
            out[r, int(np.argmax(x[r]))] = 1.0
            continue
        keep = kept(x[r], t, int(at(top_k, r)), float(at(top_p, r)), float(at(min_p, r)))
        p = np.where(keep, np.exp((x[r] - x[r].max()) / t), 0.0)
        out[r] = p / p.sum()
    return out


def torch_probabilities(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, *, dtype=None):
    """The same distribution computed as vLLM's torch fallback does (``apply_top_k_top_p``: sort
    ascending, top-k mask, softmax, cumsum, top-p mask), then min-p, in torch ops.

    ``logits``: NumPy (computed in float64 on the CPU) or a torch tensor (computed on its device in
    ``dtype``, float64 by default; benchmarks pass float32, as vLLM computes). ``temperature``: a
    number or a (rows,) tensor. Returns (rows, vocab) probabilities (for ``torch.multinomial``)."""
    import torch

    if isinstance(logits, torch.Tensor):
        x = logits.to(dtype or torch.float64)
    else:
        x = torch.as_tensor(_f64(logits))
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(x.dtype)[:, None]
    x = x / temperature
    vocab = x.shape[-1]
    srt, idx = x.sort(dim=-1, descending=False)
    if 0 < top_k < vocab:
        kth = srt.gather(1, torch.full((x.shape[0], 1), vocab - top_k, device=x.device))
        srt = srt.masked_fill(srt < kth, -float("inf"))
    if top_p < 1:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - top_p
        mask[:, -1] = False
        srt = srt.masked_fill(mask, -float("inf"))
    x = torch.empty_like(srt).scatter_(-1, idx, srt)
    probs = x.softmax(dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
