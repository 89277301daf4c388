"""What the engine loads, the same way on every tensor-parallel rank: the model's config, its
weights (whole, or one rank's shards) and the number of KV-cache pages its memory holds."""

import functools

from .. import _env

#: Tokens per page of the KV cache.
BLOCK_SIZE = 16
#: KV-cache pages under the simulator (no device memory to size it by).
SIMULATOR_PAGES = 64
LOAD_FORMATS = ("auto", "dummy")


def _check_load_format(load_format):
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")


def _dummy_config(model):
    """``(config, tokenizer)`` of random weights: a preset name, a ``ModelConfig``, or a
    checkpoint whose config is used."""
    from ..models.config import ModelConfig, load_config
    from ..models.random_model import PRESETS, ByteTokenizer, preset_config

    if isinstance(model, ModelConfig):
        return model, None
    if isinstance(model, str) and model in PRESETS:
        return preset_config(model), ByteTokenizer() if model == "tiny" else None
    return load_config(model), None


def model_config(model, load_format):
    """The ``ModelConfig`` ``load`` would give, read without any weights."""
    from ..models.config import load_config

    _check_load_format(load_format)
    return _dummy_config(model)[0] if load_format == "dummy" else load_config(model)


def load(model, dtype, load_format, seed, quantization=None, shard=None):
    """``(config, weights, tokenizer)``: a checkpoint, or random weights (``dummy``) of a
    preset name or of a checkpoint's config; ``quantization="gguf"`` keeps a GGUF's projection
    blocks packed (ValueError for anything else). ``shard``: None, or ``(rank, size)``: the
    weights are that tensor-parallel rank's shards (``distributed.sharding``); random ones are
    drawn a tensor at a time and sharded at once, so no rank holds the whole model; a checkpoint
    is read whole, then sharded."""
    from ..models.checkpoint import load_checkpoint
    from ..models.random_model import random_weights

    _check_load_format(load_format)
    if shard is not None:
        from ..distributed.sharding import shard_tensor, shard_weights

        rank, size = shard
    if load_format == "auto":
        if quantization == "gguf":
            return load_checkpoint(model, dtype, keep_blocks=True)
        config, weights, tokenizer = load_checkpoint(model, dtype)
        if shard is not None:
            weights = shard_weights(weights, config, rank, size)
        return config, weights, tokenizer
    if quantization == "gguf":
        raise ValueError("quantization='gguf': load_format='dummy' draws unquantized random "
                         "weights; use 'int4' or 'int8', or load a .gguf with Q4_0 / Q4_1 / "
                         "Q8_0 blocks")
    config, tokenizer = _dummy_config(model)
    keep = None if shard is None else functools.partial(shard_tensor, config=config, rank=rank,
                                                         size=size)
    device = "cpu" if _env.SIMULATOR else "cuda"
    return config, random_weights(config, seed=seed, dtype=dtype, device=device,
                                  keep=keep), tokenizer


def cache_pages(config, kv_cache_memory, dtype):
    """KV-cache pages of ``config``'s KV heads (a tensor-parallel rank's: its own) that
    ``kv_cache_memory`` holds: a fraction of the device memory free now (a float in (0, 1]) or
    a byte count (an int); TypeError / ValueError naming it, or when fewer than 2 pages fit."""
    c = config
    page_bytes = (2 * c.num_hidden_layers * BLOCK_SIZE * c.num_key_value_heads * c.head_dim
                  * dtype.itemsize)
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        raise TypeError(f"kv_cache_memory: expected a fraction (float) or bytes (int), got "
                        f"{type(kv_cache_memory).__name__}")
    if isinstance(kv_cache_memory, float):
        if not 0 < kv_cache_memory <= 1:
            raise ValueError(f"kv_cache_memory: expected a fraction in (0, 1], got "
                             f"{kv_cache_memory}")
        if _env.SIMULATOR:
            return SIMULATOR_PAGES
        import torch

        budget = int(kv_cache_memory * torch.cuda.mem_get_info()[0])
    else:
        budget = kv_cache_memory
    pages = budget // page_bytes
    if pages < 2:
        raise ValueError(f"kv_cache_memory: {budget} bytes hold {pages} pages of "
                         f"{page_bytes} bytes; at least 2 are needed")
    return int(pages)
