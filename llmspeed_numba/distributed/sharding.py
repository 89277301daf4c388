"""Megatron-style tensor-parallel sharding of a Llama-family model's weights.

Rank ``r`` of ``size`` keeps, under transformers' tensor names (a Linear weight is
``(out_features, in_features)``):

- q_proj (weight, bias): the rows of query heads ``r * nq / size .. (r + 1) * nq / size``;
  k_proj / v_proj: the rows of the rank's KV heads, ``r * nk / size ..`` when ``nk >= size``;
  with fewer KV heads than ranks (``size`` a multiple of ``nk``) each rank keeps the one KV head
  its query heads read, head ``r * nk // size`` (grouped-query attention maps query head ``h`` to
  KV head ``h // (nq / nk)``; ``size / nk`` ranks share it, each holding a copy);
- gate_proj / up_proj: the rows ``r * I / size .. (r + 1) * I / size`` of the intermediate;
- o_proj / down_proj: the matching columns (row-parallel: each rank's product is a partial sum
  of the output, all-reduced); o_proj's bias on rank 0 only, so the sum adds it once;
- embed_tokens / lm_head: the rows of vocabulary slice ``r * V / size .. (r + 1) * V / size``;
- norms: whole.

The fused projections are built from these by ``LlamaModel`` on each rank exactly as on one GPU
(``models/llama.py``): qkv = ``cat(q_r, k_r, v_r)``, so a rank's fused weight is the fused weight
of its own heads; gate and up interleaved in blocks of ``GATE_BLOCK`` (``ops/gemm_gated.py``),
and when ``I / size`` is a multiple of ``GATE_BLOCK`` the ranks' interleaved weights, stacked in
rank order, are the one-GPU interleaved weight row for row (each block of 8 gate rows and its 8
up rows fall in one rank's slice). A rank's model is an ordinary ``LlamaModel`` of
``shard_config``: heads, KV heads, intermediate and vocabulary divided by ``size``.
"""

import dataclasses

#: A weight's part of the model by its name's suffix: how it is split across ranks.
_ROWS_OF_Q_HEADS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_ROWS_OF_KV_HEADS = ("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                     "self_attn.v_proj.weight", "self_attn.v_proj.bias")
_ROWS_OF_INTERMEDIATE = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_ROWS_OF_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_WHOLE = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


def check_size(size, name="tensor_parallel_size"):
    """``size`` itself, or TypeError / ValueError naming ``name`` (an int >= 1)."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"{name}: expected an int, got {type(size).__name__}")
    if size < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {size}")
    return size


def check_tensor_parallel(config, size, quantization=None):
    """Raise ValueError (naming ``tensor_parallel_size``) when ``config`` cannot be split over
    ``size`` ranks, NotImplementedError for ``quantization="gguf"`` (packed blocks are not
    split); returns ``size``."""
    size = check_size(size)
    if size == 1:
        return size
    if quantization == "gguf":
        raise NotImplementedError("quantization='gguf' with tensor_parallel_size > 1: a GGUF's "
                                  "packed blocks are not split across ranks; use 'int4' / "
                                  "'int8' or None")
    c = config
    nq, nk = c.num_attention_heads, c.num_key_value_heads
    for field, value in (("num_attention_heads", nq), ("intermediate_size", c.intermediate_size),
                         ("vocab_size", c.vocab_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size: {size} does not divide the model's "
                             f"{field} {value} (each rank takes an equal share)")
    if nk % size and size % nk:
        raise ValueError(f"tensor_parallel_size: {size} must divide num_key_value_heads {nk}, "
                         f"or be a multiple of it (then each KV head is kept by "
                         f"tensor_parallel_size / num_key_value_heads ranks), got {size}")
    return size


def kv_heads(config, rank, size):
    """``(first, count)``: the KV heads rank ``rank`` of ``size`` keeps."""
    nk = config.num_key_value_heads
    if nk >= size:
        return rank * (nk // size), nk // size
    return rank * nk // size, 1


def shard_config(config, size):
    """A rank's ``ModelConfig``: ``config`` with heads, KV heads, intermediate and vocabulary
    divided by ``size`` (``check_tensor_parallel`` first)."""
    check_tensor_parallel(config, size)
    if size == 1:
        return config
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=kv_heads(config, 0, size)[1],
        intermediate_size=config.intermediate_size // size,
        vocab_size=config.vocab_size // size)


def _part(t, dim, first, count):
    """A contiguous copy, never a view: the whole tensor can be freed once its parts are taken."""
    import torch

    return t.narrow(dim, first, count).clone(memory_format=torch.contiguous_format)


def shard_tensor(name, tensor, config, rank, size):
    """Rank ``rank``'s part of weight ``name`` (a torch tensor of the shape ``config`` gives it):
    a new tensor, or None for a weight the rank does not keep (o_proj's bias off rank 0).
    ValueError for a name without a sharding rule."""
    if size == 1:
        return tensor
    d = config.head_dim
    if name.endswith(_ROWS_OF_Q_HEADS):
        per = config.num_attention_heads // size
        return _part(tensor, 0, rank * per * d, per * d)
    if name.endswith(_ROWS_OF_KV_HEADS):
        first, count = kv_heads(config, rank, size)
        return _part(tensor, 0, first * d, count * d)
    if name.endswith(_ROWS_OF_INTERMEDIATE):
        per = config.intermediate_size // size
        return _part(tensor, 0, rank * per, per)
    if name.endswith(_ROWS_OF_VOCAB):
        per = config.vocab_size // size
        return _part(tensor, 0, rank * per, per)
    if name.endswith("self_attn.o_proj.weight"):
        per = config.num_attention_heads // size * d
        return _part(tensor, 1, rank * per, per)
    if name.endswith("self_attn.o_proj.bias"):
        return tensor if rank == 0 else None
    if name.endswith("mlp.down_proj.weight"):
        per = config.intermediate_size // size
        return _part(tensor, 1, rank * per, per)
    if name.endswith(_WHOLE):
        return tensor
    raise ValueError(f"weights: no tensor-parallel sharding rule for tensor {name!r}")


def shard_weights(weights, config, rank, size):
    """Rank ``rank``'s weights: ``shard_tensor`` of each of ``weights`` (transformers' names to
    torch tensors), those it does not keep left out."""
    out = {}
    for name, tensor in weights.items():
        part = shard_tensor(name, tensor, config, rank, size)
        if part is not None:
            out[name] = part
    return out
