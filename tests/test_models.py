"""The Llama forward pass (``llmspeed_numba/models/llama.py``) against a float64 NumPy forward
written here, on a tiny 2-layer model in the simulator (on a GPU: on the GPU).

One model covers the features at once: grouped-query attention, q / k / v biases (Qwen2), a
sliding window shorter than the prompts (Mistral) and Llama 3 rope scaling. The prefill path
(packed prompts of different lengths, ``flash_attn_varlen``) and the decode path (paged cache,
``paged_decode_attention``) are both checked against the reference logits.

Tolerance, derived: the error of our bf16 logits against the float64 forward must be at most
twice that of the same NumPy forward rounding every intermediate to bf16, plus a small allowance.
"""

import math

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llmspeed_numba.models.model import Model  # noqa: E402
from llmspeed_numba.models.random_model import preset_config, random_weights  # noqa: E402
from llmspeed_numba.testing import to_host  # noqa: E402

BF16 = ml_dtypes.bfloat16
ROPE_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 2.0, "original_max_position_embeddings": 16}


def _config(**overrides):
    fields = dict(attention_bias=True, sliding_window=4, rope_scaling=ROPE_SCALING,
                  vocab_size=64, max_position_embeddings=32, eos_token_id=())
    fields.update(overrides)
    return preset_config("tiny", **fields)


def _weights(config, seed=0):
    w = random_weights(config, seed=seed, initializer_range=0.25)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in w:
        if "norm" in name:  # not all ones: a norm weight that is ignored must show
            w[name] = 1 + 0.2 * torch.randn(w[name].shape, generator=gen)
    return {k: v.to(torch.bfloat16) for k, v in w.items()}


# ---- the float64 reference ----------------------------------------------------------------

def _inv_freq(c):
    """Llama 3's scaled rotary frequencies, written out from the published formula."""
    d = c.head_dim
    inv = 1.0 / c.rope_theta ** (np.arange(0, d, 2) / d)
    s = c.rope_scaling
    if not s:
        return inv
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wl - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.array(out)


def reference_logits(c, weights, ids, rnd=lambda a: a, project_input=lambda a: a):
    """Logits (len, vocab) of one sequence; ``rnd`` rounds each intermediate (identity: float64
    throughout; bf16 rounding: the plain same-precision forward the tolerance is derived from);
    ``project_input`` maps the input of each layer projection (W8A8: its per-token
    quantization; not the LM head's)."""
    W = {k: v.float().numpy().astype(np.float64) for k, v in weights.items()}
    T, D, nq, nk = len(ids), c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def norm(x, w):
        return rnd(rnd(x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps)) * w)

    def linear(x, name, bias=None):
        y = rnd(project_input(x) @ W[name].T)
        return y if bias not in W else rnd(y + W[bias])

    angles = np.arange(T)[:, None] * _inv_freq(c)[None, :]
    cos, sin = rnd(np.cos(angles))[:, None, :], rnd(np.sin(angles))[:, None, :]

    def rotate(x):
        a, b = x[..., :D // 2], x[..., D // 2:]
        return rnd(np.concatenate([a * cos - b * sin, b * cos + a * sin], -1))

    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & ((c.sliding_window is None) | (i - j < (c.sliding_window or 0)))
    x = W["model.embed_tokens.weight"][ids]
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = norm(x, W[p + "input_layernorm.weight"])
        q = rotate(linear(h, p + "self_attn.q_proj.weight", p + "self_attn.q_proj.bias")
                   .reshape(T, nq, D))
        k = rotate(linear(h, p + "self_attn.k_proj.weight", p + "self_attn.k_proj.bias")
                   .reshape(T, nk, D))
        v = linear(h, p + "self_attn.v_proj.weight", p + "self_attn.v_proj.bias").reshape(
            T, nk, D)
        attn = np.empty((T, nq, D))
        for head in range(nq):
            kv = head // (nq // nk)
            s = np.where(allowed, q[:, head] @ k[:, kv].T / math.sqrt(D), -np.inf)
            prob = np.exp(s - s.max(-1, keepdims=True))
            attn[:, head] = rnd(prob @ v[:, kv] / prob.sum(-1, keepdims=True))
        x = rnd(x + linear(attn.reshape(T, nq * D), p + "self_attn.o_proj.weight"))
        h = norm(x, W[p + "post_attention_layernorm.weight"])
        g, u = linear(h, p + "mlp.gate_proj.weight"), linear(h, p + "mlp.up_proj.weight")
        x = rnd(x + linear(rnd(rnd(g / (1 + np.exp(-g))) * u), p + "mlp.down_proj.weight"))
    head_name = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    return norm(x, W["model.norm.weight"]) @ W[head_name].T


def _bf16(a):
    return np.asarray(a).astype(BF16).astype(np.float64)


def _check_logits(got, c, weights, ids, what, rows=slice(None), project_input=lambda a: a):
    """``got`` against the float64 forward's logits of ``ids`` (its ``rows``), with the bound
    derived from the plain bf16 forward (``project_input``: see ``reference_logits``)."""
    exact = reference_logits(c, weights, ids, project_input=project_input)[rows]
    plain = reference_logits(c, weights, ids, _bf16, project_input)[rows]
    err = np.abs(np.asarray(got, np.float64) - exact).max()
    plain_err = np.abs(plain - exact).max()
    bound = 2 * plain_err + 1e-3 * np.abs(exact).max()
    assert err <= bound, (f"{what}: max |ours - float64| = {err:.3g} > {bound:.3g} (2 x the "
                          f"plain bf16 forward's {plain_err:.3g} + allowance)")


# ---- tests ----------------------------------------------------------------------------------

def test_prefill_and_decode_logits_match_float64_forward():
    c = _config()
    weights = _weights(c)
    model = Model(c, None, weights)
    prompts = [[3, 17, 42, 8, 61, 5, 29], [11, 2, 50]]
    logits = model.prefill_logits(prompts)
    for b, prompt in enumerate(prompts):
        assert logits[b].shape == (len(prompt), c.vocab_size)
        _check_logits(logits[b].numpy(), c, weights, prompt, f"prefill of prompt {b}")

    # a decode step over the paged cache, fed tokens of our choosing
    cache, seqs = model._new_cache([np.array(p) for p in prompts], 1)
    model.llama.forward(model._prefill_step(cache, seqs, [np.array(p) for p in prompts]), cache)
    fed = [[7], [60]]
    for step in range(1):
        tokens = [f[step] for f in fed]
        got = to_host(model.llama.forward(model._decode_step(cache, seqs, tokens), cache))
        for b, prompt in enumerate(prompts):
            _check_logits(got[b], c, weights, prompt + fed[b][:step + 1],
                          f"decode step {step} of prompt {b}", rows=-1)


def test_generate_greedy_follows_the_reference_argmax():
    c = _config(attention_bias=False, sliding_window=None, rope_scaling=None,
                tie_word_embeddings=True, num_hidden_layers=1)
    weights = _weights(c, seed=3)
    weights.pop("lm_head.weight", None)
    model = Model(c, None, weights)
    prompts = [[5, 9, 13], [40]]
    out = model.generate_greedy(prompts, 2)
    assert [len(o) for o in out] == [2, 2]
    for prompt, new in zip(prompts, out):
        ids = list(prompt)
        for token in new:
            ref = reference_logits(c, weights, ids)[-1]
            top2 = np.sort(ref)[-2:]
            if top2[1] - top2[0] > 0.05 * np.abs(ref).max():  # a clear winner
                assert token == int(np.argmax(ref)), (prompt, ids, token, int(np.argmax(ref)))
            ids.append(token)


def test_generate_stops_at_eos():
    c = _config(num_hidden_layers=1, eos_token_id=tuple(range(64)))  # every token ends
    model = Model(c, None, _weights(c))
    assert [len(o) for o in model.generate_greedy([[1, 2], [3]], 5)] == [1, 1]


def test_bad_prompts_and_weights():
    c = _config(num_hidden_layers=1)
    weights = _weights(c)
    model = Model(c, None, weights)
    with pytest.raises(ValueError, match=r"exceed the model's context of 32"):
        model.generate_greedy([[1] * 30], 3)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]: expected a non-empty"):
        model.generate_greedy([[1], []], 1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        model.generate_greedy([[64]], 1)
    with pytest.raises(ValueError, match="non-empty list"):
        model.generate_greedy([], 1)
    with pytest.raises(TypeError, match="max_new_tokens: expected an int"):
        model.generate_greedy([[1]], 1.5)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        Model(c, None, weights, dtype="float32")
    with pytest.raises(TypeError, match="dtype: expected a torch dtype"):
        Model(c, None, weights, dtype=3)
    broken = dict(weights)
    del broken["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        Model(c, None, broken)
    broken = dict(weights)
    broken["model.norm.weight"] = broken["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(31,\), expected "
                                         r"\(32,\)"):
        Model(c, None, broken)
