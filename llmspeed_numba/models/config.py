"""The model's shapes and hyperparameters, from a Hugging Face ``config.json`` or GGUF metadata.

Field names are transformers' ``LlamaConfig`` ones, so a config reads the same as on the Hub.
Supported: Llama 2 / 3 / 3.1 (``rope_scaling`` of type ``llama3``), Mistral (sliding window),
Qwen2 (q/k/v biases); GQA / MQA through ``num_key_value_heads``; tied embeddings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# model_type -> architecture name, the ones the forward pass implements.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED_MODEL_TYPES.values())
# rope types we implement; "default" is plain RoPE, stored as rope_scaling=None.
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


@dataclass
class ModelConfig:
    """A decoder-only Llama-family model.

    ``head_dim`` may differ from ``hidden_size // num_attention_heads``; ``rope_scaling`` is None
    or ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``; ``sliding_window`` is None (full attention) or the
    window in tokens; ``attention_bias`` means q/k/v projections have biases (o_proj has none);
    ``eos_token_ids`` is a tuple (HF allows an int or a list).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.eos_token_id = _token_ids(self.eos_token_id)
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    def weight_names(self) -> list[str]:
        """Every tensor the model needs, by its Hugging Face name (``lm_head.weight`` only when
        the embeddings are not tied; q/k/v biases only with ``attention_bias``)."""
        names = ["model.embed_tokens.weight"]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            if self.attention_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names.append("model.norm.weight")
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """``weight_names()`` -> the shape the forward expects (out_features, in_features)."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv, f = self.num_key_value_heads * self.head_dim, self.intermediate_size
        by_suffix = {
            "embed_tokens.weight": (self.vocab_size, h), "lm_head.weight": (self.vocab_size, h),
            "layernorm.weight": (h,), "norm.weight": (h,),
            "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
            "o_proj.weight": (h, q), "q_proj.bias": (q,), "k_proj.bias": (kv,),
            "v_proj.bias": (kv,), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
            "down_proj.weight": (h, f),
        }
        shapes = {}
        for name in self.weight_names():
            suffix = next(s for s in by_suffix if name.endswith(s))
            shapes[name] = by_suffix[suffix]
        return shapes

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """From a parsed ``config.json`` (transformers 4 ``rope_theta``/``rope_scaling`` or
        transformers 5 ``rope_parameters``). Raises ValueError for an unsupported model type or
        architecture, NotImplementedError for an unsupported rope type, activation or layout."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a dict, got {type(d).__name__}")
        architectures = d.get("architectures") or []
        model_type = d.get("model_type")
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported or (model_type not in SUPPORTED_MODEL_TYPES and not architectures):
            got = unsupported[0] if unsupported else model_type
            raise ValueError(
                f"unsupported architecture {got!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                f" (model_type {', '.join(SUPPORTED_MODEL_TYPES)})")
        architecture = architectures[0] if architectures else SUPPORTED_MODEL_TYPES[model_type]
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"config hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        if d.get("mlp_bias"):
            raise NotImplementedError("config mlp_bias=True: MLP biases are not supported")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if d.get(k) is None]
        if missing:
            raise ValueError(f"config: missing required field(s) {', '.join(missing)}")

        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        rope_scaling = d.get("rope_scaling") or rope or None

        sliding_window = None
        if architecture == "MistralForCausalLM":
            sliding_window = d.get("sliding_window")
        elif architecture == "Qwen2ForCausalLM" and d.get("use_sliding_window"):
            sliding_window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if layer_types and sliding_window is not None and len(set(layer_types)) > 1:
            raise NotImplementedError(
                "config layer_types: a mix of sliding and full attention layers is not supported")
        if layer_types and set(layer_types) == {"full_attention"}:
            sliding_window = None

        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            # Qwen2 always has q/k/v biases and its config has no flag for them.
            attention_bias=(architecture == "Qwen2ForCausalLM") or bool(d.get("attention_bias")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            architecture=architecture,
        )

    @classmethod
    def from_gguf(cls, reader) -> ModelConfig:
        """From the metadata of a ``gguf.GGUFReader`` (or a .gguf path) of a ``llama`` GGUF.

        ``tie_word_embeddings`` is True when the file has no ``output.weight`` tensor. Raises
        ValueError for another architecture or missing keys, NotImplementedError for rope scaling
        other than none/llama3 (a ``rope_freqs`` tensor, llama.cpp's form of llama3 scaling, has
        no parameters to rebuild the config from)."""
        from .gguf_loader import gguf_metadata, open_gguf

        if isinstance(reader, (str, os.PathLike)):
            reader = open_gguf(reader)
        meta = gguf_metadata(reader)
        where = getattr(reader, "_llmspeed_path", "GGUF")
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"{where}: unsupported GGUF architecture {arch!r}; supported: 'llama'")

        def get(key, default=KeyError):
            if f"llama.{key}" in meta:
                return meta[f"llama.{key}"]
            if default is KeyError:
                raise ValueError(f"{where}: missing GGUF metadata key 'llama.{key}'")
            return default

        tensor_names = {t.name for t in reader.tensors}
        if "rope_freqs.weight" in tensor_names:
            raise NotImplementedError(
                f"{where}: rope scaling stored as a 'rope_freqs' tensor (llama.cpp's Llama 3.1 "
                "form) is not supported; load the Hugging Face checkpoint instead")
        rope_scaling = None
        scaling_type = get("rope.scaling.type", "none")
        if scaling_type not in ("none", None):
            rope_scaling = {"rope_type": scaling_type}
            for gguf_key, hf_key in (("factor", "factor"),
                                     ("original_context_length",
                                      "original_max_position_embeddings")):
                if f"llama.rope.scaling.{gguf_key}" in meta:
                    rope_scaling[hf_key] = meta[f"llama.rope.scaling.{gguf_key}"]

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = meta.get("llama.vocab_size")
        if vocab is None:
            if "tokenizer.ggml.tokens" not in reader.fields:
                raise ValueError(f"{where}: no 'llama.vocab_size' and no tokenizer.ggml.tokens")
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        head_dim = get("attention.key_length", None) or get("rope.dimension_count", None)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(head_dim) if head_dim else hidden // heads,
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            sliding_window=None,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=() if eos is None else (int(eos),),
            architecture="LlamaForCausalLM",
        )


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise TypeError(f"eos_token_id: expected an int or a list of ints, got {value!r}")


def _check_rope_scaling(rope_scaling: Any) -> dict | None:
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling: expected a dict or None, got {type(rope_scaling).__name__}")
    # transformers 4 spelled the key "type" in older configs.
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (or no rope_scaling)")
    if rope_type == "default":
        return None
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3': missing {', '.join(missing)}")
    scaling = {"rope_type": "llama3"}
    scaling.update({k: float(rope_scaling[k]) for k in _LLAMA3_ROPE_KEYS})
    scaling["original_max_position_embeddings"] = int(
        rope_scaling["original_max_position_embeddings"])
    return scaling


def _read_config_json(path: str) -> ModelConfig:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return ModelConfig.from_hf_dict(d)


def load_config(model: str | os.PathLike | None = None) -> ModelConfig:
    """The config of ``model`` without loading weights: a Hugging Face directory (its
    ``config.json``), a ``config.json`` path, a ``.gguf`` file, or None for the embedded default
    model. Raises FileNotFoundError naming a missing path, ValueError for a file that is neither."""
    if model is None:
        from .default import default_model_path

        model = default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model: expected a path or None, got {type(model).__name__}")
    path = os.fspath(model)
    if os.path.isdir(path):
        config_json = os.path.join(path, "config.json")
        if not os.path.isfile(config_json):
            raise FileNotFoundError(f"{path}: a model directory needs config.json, none found")
        return _read_config_json(config_json)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: no such file or directory: {path}")
    if path.endswith(".gguf"):
        return ModelConfig.from_gguf(path)
    if path.endswith(".json"):
        return _read_config_json(path)
    raise ValueError(f"model: {path} is neither a directory, a config.json nor a .gguf file")
