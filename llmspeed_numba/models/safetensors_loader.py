"""Weights of a Hugging Face checkpoint directory, through the ``safetensors`` library.

The directory holds ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` listed by
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> shard file). Tensors keep
their Hugging Face names and layout (``nn.Linear``: ``(out_features, in_features)``).
"""

from __future__ import annotations

import json
import os

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _tensor_files(path: str, names: list[str]) -> dict[str, str]:
    """Tensor name -> the file that holds it, for the names the model needs."""
    single = os.path.join(path, SINGLE_FILE)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        return {n: os.path.join(path, weight_map[n]) for n in names if n in weight_map}
    if os.path.isfile(single):
        return {n: single for n in names}
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE} (sharded checkpoint)")


def load_hf_weights(path, dtype="bfloat16", config=None) -> dict:
    """Every weight the model needs from a Hugging Face directory, as CPU tensors of ``dtype``
    (a torch dtype or its name), keyed by Hugging Face name (``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` ..., ``lm_head.weight`` only when not
    tied). Tensors the model does not use (a tied ``lm_head``, old ``rotary_emb.inv_freq``) are
    skipped. ``config``: the directory's ModelConfig (read when None).

    Raises FileNotFoundError naming a missing directory / file, ValueError naming the file for a
    corrupt file or a missing or misshapen tensor."""
    from safetensors import safe_open

    from ._dtypes import torch_dtype
    from .config import load_config

    dtype = torch_dtype(dtype)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint directory not found: {path}")
    config = config or load_config(path)
    shapes = config.weight_shapes()
    files = _tensor_files(path, list(shapes))
    missing = [n for n in shapes if n not in files]
    if missing:
        raise ValueError(f"{os.path.join(path, INDEX_FILE)}: no shard holds tensor(s) "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)

    weights = {}
    for file, names in by_file.items():
        if not os.path.isfile(file):
            raise FileNotFoundError(f"safetensors file not found: {file}")
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ValueError(f"{file}: missing tensor {name!r}")
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != shapes[name]:
                        raise ValueError(f"{file}: tensor {name!r}: expected shape "
                                         f"{shapes[name]}, got {tuple(tensor.shape)}")
                    weights[name] = tensor.to(dtype)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises SafetensorError for a bad header / size
            raise ValueError(f"{file}: not a readable safetensors file "
                             f"({type(e).__name__}: {e})") from None
    return weights
