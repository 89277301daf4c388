"""Weights and metadata of a llama-architecture GGUF file, through the ``gguf`` package.

Tensors come back under their Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``
...), dequantized and in Hugging Face's layout, so both checkpoint formats feed one forward:

- GGUF lists dimensions innermost first (``ne``); ``GGUFReader`` already gives each tensor's data
  row-major as ``(out_features, in_features)`` (for block types ``(out_features, row bytes)``), the
  ``nn.Linear`` orientation, so no transpose is needed.
- llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` (weights and biases) per
  head from rotate-half pairs ``(j, j + d/2)`` to interleaved pairs ``(2j, 2j + 1)``, its rotary
  convention: ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``. We undo it
  (``unpermute_qk``), with ``n_head`` for Q and ``n_head_kv`` for K, so the forward uses HF's
  rotate-half rotary.

With ``keep_blocks`` (``quantization="gguf"``), the projection weights stored as Q4_0 / Q4_1 /
Q8_0 come back packed, as ``GGUFBlocks``: their raw block rows (a row of blocks per output
feature, independent of the others), un-permuted as whole rows the same way, so row ``n`` of the
packed tensor is row ``n`` of the dequantized one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF tensor name (without ".weight"/".bias") -> Hugging Face module name; {i} is the block.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
#: HF module names of the projection weights ``keep_blocks`` may keep packed.
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: Block types ``QuantizedWeight.from_gguf`` keeps packed.
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def _supported_types():
    from gguf import GGMLQuantizationType as T

    return (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1)


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped; nothing is dequantized yet).

    Raises FileNotFoundError for a missing file, ValueError naming the file when it is not a
    readable GGUF (bad magic, truncated, inconsistent offsets)."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors, ...
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    reader._llmspeed_path = path
    return reader


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.STRING and isinstance(value, bytes):
        value = value.decode("utf-8")
    return value


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool, or a list for arrays)."""
    field = reader.fields.get(key)
    return default if field is None else _field_value(field)


def gguf_metadata(reader) -> dict[str, Any]:
    """Every scalar metadata value (strings and numbers) of the reader; arrays (the tokenizer's
    vocabulary, merges) are left out: read them with ``gguf_field``."""
    from gguf import GGUFValueType

    return {key: _field_value(f) for key, f in reader.fields.items()
            if f.types and f.types[0] != GGUFValueType.ARRAY}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for a name with no HF counterpart."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        block, part, kind = m.groups()
        module = _BLOCK_NAMES.get(part)
        return None if module is None else f"model.layers.{block}.{module}.{kind}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def gguf_name(hf: str) -> str:
    """The inverse of ``hf_name``: the llama GGUF name of a Hugging Face tensor name."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    if m:
        block, module, kind = m.groups()
        part = next(k for k, v in _BLOCK_NAMES.items() if v == module)
        return f"blk.{block}.{part}.{kind}"
    module, kind = hf.rsplit(".", 1)
    part = next(k for k, v in _GLOBAL_NAMES.items() if v == module)
    return f"{part}.{kind}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` (convert_hf_to_gguf): HF rows -> GGUF rows, per head."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``: GGUF rows -> HF rows (``n_head`` heads of Q, or of K)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@dataclass(frozen=True, eq=False)
class GGUFBlocks:
    """A projection weight kept in its GGUF blocks: ``data`` (N, row bytes) uint8 on the host,
    rows in Hugging Face order; ``ggml_type`` "Q4_0", "Q4_1" or "Q8_0"; ``shape`` (N, K), the
    matrix it stands for. Rows of blocks concatenate (``concat``) into a fused weight."""

    data: np.ndarray
    ggml_type: str
    shape: tuple

    def dequantize(self) -> np.ndarray:
        """The (N, K) float32 values (the ``gguf`` package's dequantization)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(self.data, GGMLQuantizationType[self.ggml_type]).reshape(self.shape)

    @staticmethod
    def concat(parts: list[GGUFBlocks]) -> GGUFBlocks:
        """The row concatenation of ``parts`` (one block type, one K): q, k, v or gate, up
        fused into one weight. Raises ValueError for mixed types or K."""
        types = {p.ggml_type for p in parts}
        ks = {p.shape[1] for p in parts}
        if len(types) != 1 or len(ks) != 1:
            raise ValueError(f"GGUFBlocks.concat: expected one block type and one K, got types "
                             f"{sorted(types)} and K {sorted(ks)}")
        return GGUFBlocks(np.concatenate([p.data for p in parts]), parts[0].ggml_type,
                          (sum(p.shape[0] for p in parts), parts[0].shape[1]))


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)


def dequantize_tensor(tensor, where: str = "GGUF") -> np.ndarray:
    """A ``ReaderTensor``'s values as a float32 array of shape (rows, cols) (or (n,) for 1-D).

    Raises NotImplementedError naming the tensor and its type for unsupported types."""
    from gguf.quants import dequantize

    if tensor.tensor_type not in _supported_types():
        raise NotImplementedError(
            f"{where}: tensor {tensor.name!r} has type {tensor.tensor_type.name}; supported: "
            f"{', '.join(t.name for t in _supported_types())}")
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ne order -> row-major
    if values.shape != shape:
        raise ValueError(f"{where}: tensor {tensor.name!r} dequantized to {values.shape}, "
                         f"expected {shape} from its header")
    return values


def load_gguf_weights(path, dtype="bfloat16", config=None, *, keep_blocks=False) -> dict:
    """Every weight of a llama GGUF, dequantized to ``dtype`` on the CPU, under Hugging Face
    names and in Hugging Face's layout (Q/K rows un-permuted; ``lm_head.weight`` absent when tied).

    ``path``: a .gguf path or a ``GGUFReader``; ``config``: its ModelConfig (read when None).
    ``keep_blocks``: projection weights of a block type in ``BLOCK_TYPES`` come back as
    ``GGUFBlocks`` instead (raises ValueError when there is none: the file is not quantized so).
    Raises FileNotFoundError / ValueError naming the file (unreadable, unknown tensor name, wrong
    shape, missing tensor), NotImplementedError naming a tensor of an unsupported type."""
    import torch

    from .config import ModelConfig
    from ._dtypes import torch_dtype

    dtype = torch_dtype(dtype)
    reader = path if hasattr(path, "tensors") else open_gguf(path)
    where = getattr(reader, "_llmspeed_path", "GGUF")
    config = config or ModelConfig.from_gguf(reader)
    shapes = config.weight_shapes()
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{where}: unexpected tensor {tensor.name!r} for a llama model")
        if name not in shapes:
            if name == "lm_head.weight":  # tied, but the file carries a copy: the embedding wins
                continue
            raise ValueError(f"{where}: tensor {tensor.name!r} ({name}) is not part of a model "
                             f"with this config")
        if keep_blocks and _is_projection(name) and tensor.tensor_type.name in BLOCK_TYPES:
            weights[name] = _blocks(tensor, name, shapes[name], config, where)
            continue
        values = dequantize_tensor(tensor, where)
        if values.shape != shapes[name]:
            raise ValueError(f"{where}: tensor {tensor.name!r} ({name}): expected shape "
                             f"{shapes[name]}, got {values.shape}")
        if ".self_attn.q_proj." in name:
            values = unpermute_qk(values, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            values = unpermute_qk(values, config.num_key_value_heads)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
            values = values.copy()
        weights[name] = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    if keep_blocks and not any(isinstance(w, GGUFBlocks) for w in weights.values()):
        types = sorted({t.tensor_type.name for t in reader.tensors
                        if _is_projection(hf_name(t.name) or "")})
        raise ValueError(f"{where}: quantization='gguf' runs the projection weights from their "
                         f"{'/'.join(BLOCK_TYPES)} blocks, but this file stores them as "
                         f"{'/'.join(types) or 'nothing'}; use quantization='int4' or 'int8' to "
                         f"quantize at load")
    missing = [n for n in shapes if n not in weights]
    if missing:
        names = ", ".join(gguf_name(n) for n in missing[:5])
        raise ValueError(f"{where}: missing tensor(s) {names}"
                         f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    return weights


def _blocks(tensor, name, shape, config, where) -> GGUFBlocks:
    """A block-type projection tensor's raw rows, Q / K rows un-permuted as whole rows."""
    n, k = shape
    header = tuple(int(v) for v in reversed(tensor.shape))
    if header != (n, k):
        raise ValueError(f"{where}: tensor {tensor.name!r} ({name}): expected shape {shape}, "
                         f"got {header}")
    data = np.asarray(tensor.data).reshape(n, -1)
    if ".self_attn.q_proj." in name:
        data = unpermute_qk(data, config.num_attention_heads)
    elif ".self_attn.k_proj." in name:
        data = unpermute_qk(data, config.num_key_value_heads)
    return GGUFBlocks(np.array(data, np.uint8, order="C"), tensor.tensor_type.name, (n, k))
