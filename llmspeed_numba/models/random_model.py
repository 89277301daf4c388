"""Random-weight models: the shapes of known models without their checkpoints.

For benchmarks of large shapes (``load_format="dummy"``), for the simulator demo, and for tests.
Weights are drawn as transformers initialises a Llama (normal, std ``initializer_range``; norms
at one), under transformers' tensor names, so the same dictionary loads into transformers too.
"""

from .config import ModelConfig

#: Config fields of known shapes (transformers' names).
PRESETS = {
    # the simulator demo: small enough for numba's CUDA simulator (seconds a token)
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256,
                 max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5),
    # 140 GB of bf16 weights: more than one GPU holds (tensor parallelism's benchmark)
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                        rms_norm_eps=1e-5),
}


def preset_config(name, **overrides):
    """``ModelConfig`` of a preset (``PRESETS``), with fields overridden (e.g. num_hidden_layers)."""
    if name not in PRESETS:
        raise ValueError(f"config: expected one of {tuple(PRESETS)}, got {name!r}")
    fields = dict(architecture="LlamaForCausalLM", tie_word_embeddings=False)
    fields.update(PRESETS[name])
    fields.update(overrides)
    return ModelConfig(**fields)


def random_weights(config, *, seed=0, dtype=None, device="cpu", initializer_range=0.02,
                   keep=None):
    """transformers-named random weights of ``config`` (a dict of torch tensors). ``keep``:
    None, or ``keep(name, tensor)`` applied to each tensor as it is drawn, its result stored
    (None: left out), e.g. a tensor-parallel rank's shard, so that the whole model is never
    held at once; the draws, and so the values, are the same either way."""
    import torch

    dtype = dtype or torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def normal(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
                * initializer_range).to(dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    w = {}

    def put(name, tensor):
        if keep is not None:
            tensor = keep(name, tensor)
        if tensor is not None:
            w[name] = tensor

    put("model.embed_tokens.weight", normal(c.vocab_size, c.hidden_size))
    put("model.norm.weight", ones(c.hidden_size))
    if not c.tie_word_embeddings:
        put("lm_head.weight", normal(c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", ones(c.hidden_size))
        put(p + "post_attention_layernorm.weight", ones(c.hidden_size))
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            put(p + f"self_attn.{name}_proj.weight", normal(rows, c.hidden_size))
            if c.attention_bias:
                put(p + f"self_attn.{name}_proj.bias", normal(rows))
        put(p + "self_attn.o_proj.weight", normal(c.hidden_size, q))
        put(p + "mlp.gate_proj.weight", normal(c.intermediate_size, c.hidden_size))
        put(p + "mlp.up_proj.weight", normal(c.intermediate_size, c.hidden_size))
        put(p + "mlp.down_proj.weight", normal(c.hidden_size, c.intermediate_size))
    return w


class ByteTokenizer:
    """UTF-8 bytes as token ids (ids 0-255): the tokenizer of the ``tiny`` random model, so the
    simulator demo runs the whole text-to-text path without a trained vocabulary."""

    vocab_size = 256
    bos_token_id = None
    eos_token_ids = frozenset()

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
            "assistant: " if add_generation_prompt else "")
