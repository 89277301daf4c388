"""llmspeed_numba: LLM-inference GPU kernels written in Python with Numba CUDA.

Ops take numba device arrays, CuPy arrays or PyTorch CUDA tensors (no copies) and return results
in the caller's kind. Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in numba's CUDA
simulator, on NumPy arrays. Without a GPU and without that variable the import succeeds and the
first op call (or ``PagedKVCache``) raises ``NoCudaError`` saying so.
"""

import importlib
from typing import TYPE_CHECKING

from . import _env  # noqa: F401  (NumPy / simulator fixes before anything compiles)
from ._env import SIMULATOR, NoCudaError, have_gpu
from .autotune import autotune

#: public name -> the module defining it, imported at first use (PEP 562): the package's import
#: costs numba-cuda and ``_env``; an op's modules load when the op is first touched (the
#: engine's also import torch). ``compile_check`` imports every ops module itself.
_LAZY = {
    **dict.fromkeys(("flash_attn", "flash_attn_varlen"), ".ops.flash_attn"),
    **dict.fromkeys(("gemm", "GemmConfig"), ".ops.gemm"),
    **dict.fromkeys(("deinterleave_gate_up", "interleave_gate_up"), ".ops.gemm_gated"),
    **dict.fromkeys(("gelu", "gelu_and_mul", "silu_and_mul"), ".ops.activations"),
    "embedding": ".ops.embedding",
    "layer_norm": ".ops.layer_norm",
    "paged_decode_attention": ".ops.paged_decode",
    "paged_kv_append": ".ops.paged_kv_append",
    "paged_prefill_attention": ".ops.paged_prefill",
    **dict.fromkeys(("quant_gemm", "quant_gemm_rms_norm"), ".ops.quant_gemm"),
    **dict.fromkeys(("QuantizedWeight", "quantize_weight"), ".ops.quant_weight"),
    "rms_norm": ".ops.rms_norm",
    "rotary_embedding": ".ops.rotary",
    "rotary_kv_append": ".ops.rotary_kv_append",
    "sample": ".ops.sample",
    "argmax": ".ops.argmax",
    "softmax": ".ops.softmax",
    **dict.fromkeys(("OutOfPages", "PageAllocator", "PagedKVCache"), ".paged_cache"),
    **dict.fromkeys(("LLM", "SamplingParams", "RequestOutput"), ".engine"),
}

if TYPE_CHECKING:
    from .engine import LLM, RequestOutput, SamplingParams
    from .ops.activations import gelu, gelu_and_mul, silu_and_mul
    from .ops.argmax import argmax
    from .ops.embedding import embedding
    from .ops.flash_attn import flash_attn, flash_attn_varlen
    from .ops.gemm import GemmConfig, gemm
    from .ops.gemm_gated import deinterleave_gate_up, interleave_gate_up
    from .ops.layer_norm import layer_norm
    from .ops.paged_decode import paged_decode_attention
    from .ops.paged_kv_append import paged_kv_append
    from .ops.paged_prefill import paged_prefill_attention
    from .ops.quant_gemm import quant_gemm, quant_gemm_rms_norm
    from .ops.quant_weight import QuantizedWeight, quantize_weight
    from .ops.rms_norm import rms_norm
    from .ops.rotary import rotary_embedding
    from .ops.rotary_kv_append import rotary_kv_append
    from .ops.sample import sample
    from .ops.softmax import softmax
    from .paged_cache import OutOfPages, PageAllocator, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "SIMULATOR", "have_gpu", "NoCudaError", "__version__",
    "gemm", "GemmConfig", "autotune", "interleave_gate_up", "deinterleave_gate_up",
    "flash_attn", "flash_attn_varlen",
    "rms_norm", "layer_norm", "rotary_embedding", "silu_and_mul", "gelu", "gelu_and_mul",
    "softmax", "argmax", "sample", "embedding",
    "quant_gemm", "quant_gemm_rms_norm", "quantize_weight", "QuantizedWeight",
    "paged_decode_attention", "paged_prefill_attention", "paged_kv_append", "rotary_kv_append",
    "PagedKVCache",
    "PageAllocator", "OutOfPages",
    "LLM", "SamplingParams", "RequestOutput",
]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmspeed_numba' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
