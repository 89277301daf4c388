"""One entry for every checkpoint kind: ``load_checkpoint(model, dtype)``."""

from __future__ import annotations

import os

from .config import ModelConfig, load_config


def load_checkpoint(model=None, dtype="bfloat16", *, keep_blocks=False):
    """``(ModelConfig, weights, Tokenizer)`` of ``model``: a Hugging Face directory
    (safetensors), a ``.gguf`` file, or None for the embedded default (SmolLM2-135M-Instruct).

    ``weights`` maps Hugging Face names to CPU tensors of ``dtype`` (a torch dtype or its name)
    in Hugging Face's layout, whatever the format. ``keep_blocks`` (``quantization="gguf"``):
    a GGUF's Q4_0 / Q4_1 / Q8_0 projection weights stay packed (``gguf_loader.GGUFBlocks``);
    ValueError for a Hugging Face directory or a GGUF without such weights. Raises FileNotFoundError naming a missing path,
    ValueError for a path that is neither kind, an unsupported architecture or a corrupt file,
    NotImplementedError for an unsupported tensor type or rope scaling."""
    from ._dtypes import torch_dtype
    from .tokenizer import Tokenizer

    dtype = torch_dtype(dtype)
    if model is None:
        from .default import default_model_path

        model = default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model: expected a path or None, got {type(model).__name__}")
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: no such file or directory: {path}")
    if os.path.isdir(path):
        from .safetensors_loader import load_hf_weights

        if keep_blocks:
            raise ValueError(f"quantization='gguf': {path} is a Hugging Face directory, not a "
                             f".gguf file with Q4_0 / Q4_1 / Q8_0 blocks; use 'int4' or 'int8' "
                             f"to quantize it at load")
        config = load_config(path)
        weights = load_hf_weights(path, dtype, config)
        return config, weights, Tokenizer.from_hf_dir(path)
    if path.endswith(".gguf"):
        from .gguf_loader import load_gguf_weights, open_gguf

        reader = open_gguf(path)
        config = ModelConfig.from_gguf(reader)
        weights = load_gguf_weights(reader, dtype, config, keep_blocks=keep_blocks)
        return config, weights, Tokenizer.from_gguf(reader)
    raise ValueError(f"model: {path} is neither a model directory nor a .gguf file")
