"""Llama-family models on llmspeed_numba's ops: configs, checkpoints (Hugging Face safetensors
directories and GGUF files) and tokenizers. Needs the ``models`` extra (torch, safetensors, gguf,
tokenizers, jinja2)."""

from .config import ModelConfig, load_config
from .model import Model, load_model

__all__ = ["Model", "ModelConfig", "load_config", "load_model"]
