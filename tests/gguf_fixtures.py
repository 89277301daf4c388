"""GGUF files for tests, written with the ``gguf`` package's writer (test helper, not a test).

- ``write_gguf(path, config, hf_weights, qtypes, tokenizer_from)``: a llama GGUF from Hugging Face
  weights the way llama.cpp's converter writes one: GGUF tensor names, Q/K rows permuted for
  llama.cpp's rotary, 2-D weights quantized with ``gguf.quants.quantize``, norms in F32.
- ``truncate_gguf(src, dst, num_layers)``: a real GGUF cut to its first blocks, raw bytes copied.
- ``small_tokenizer()``: a byte-level BPE vocabulary small enough for a tiny model.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from llmspeed_numba.models.gguf_loader import gguf_name, open_gguf, permute_qk
from llmspeed_numba.models.tokenizer import _byte_spelling

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGES = ("Ġ t", "h e", "Ġt he", "i n", "e r")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def small_tokenizer() -> tuple[list[str], list[str], list[int]]:
    """``(tokens, merges, token_types)``: 3 control tokens, the 256 byte tokens, 5 merges."""
    tokens = list(SPECIAL_TOKENS) + [_byte_spelling()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in _MERGES]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, list(_MERGES), types


def _to_gguf_array(name: str, values: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if values.ndim == 1 or qtype == Q.F32:
        return values.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return values.astype(np.float16), Q.F16
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def write_gguf(path, config, hf_weights: dict, qtypes=Q.F32, tokenizer_from=None,
               name: str = "tiny llama") -> None:
    """Write ``hf_weights`` (HF names -> tensors or arrays) of a llama ``config`` as a GGUF.

    ``qtypes``: one GGMLQuantizationType for every 2-D weight, or a dict HF name -> type (others
    F32); 1-D tensors are always F32, as llama.cpp writes norms. ``tokenizer_from``: a GGUF path
    whose ``tokenizer.*`` metadata is copied, or None for ``small_tokenizer()``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer_from is None:
        tokens, merges, types = small_tokenizer()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    else:
        reader = open_gguf(tokenizer_from)
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub)

    for hf, tensor in hf_weights.items():
        values = tensor.float().numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
        if ".self_attn.q_proj." in hf:
            values = permute_qk(values, config.num_attention_heads)
        elif ".self_attn.k_proj." in hf:
            values = permute_qk(values, config.num_key_value_heads)
        qtype = qtypes.get(hf, Q.F32) if isinstance(qtypes, dict) else qtypes
        data, qtype = _to_gguf_array(hf, values, qtype)
        if data.dtype == np.uint8:  # block data: (rows, row bytes)
            writer.add_tensor(gguf_name(hf), data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(hf), data)
    _finish(writer)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def truncate_gguf(src, dst, num_layers: int) -> None:
    """Copy the llama GGUF ``src`` to ``dst`` keeping blocks ``0 .. num_layers - 1``, the
    embeddings, the output norm and head, and all other metadata (tokenizer included), with
    ``llama.block_count`` set to ``num_layers``. Tensor bytes are copied as they are (no
    re-quantization). ``src``: a path or a ``gguf.GGUFReader``."""
    reader = src if hasattr(src, "tensors") else open_gguf(src)
    block_count = int(reader.fields["llama.block_count"].contents())
    if not 0 < num_layers <= block_count:
        raise ValueError(f"num_layers: expected 1..{block_count}, got {num_layers}")
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        if key == "llama.block_count":
            writer.add_block_count(num_layers)
            continue
        if key == "general.alignment":
            writer.data_alignment = int(field.contents())
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= num_layers:
            continue
        data = np.array(tensor.data)  # out of the memory map, which closes with the reader
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    _finish(writer)
