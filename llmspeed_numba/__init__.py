"""llmspeed_numba: LLM-inference GPU kernels written in Python with Numba CUDA.

Ops take numba device arrays, CuPy arrays or PyTorch CUDA tensors (no copies) and return results
in the caller's kind. Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in numba's CUDA
simulator, on NumPy arrays. Without a GPU and without that variable the import succeeds and the
first op call (or ``PagedKVCache``) raises ``NoCudaError`` saying so.
"""

from . import _env  # noqa: F401  (NumPy / simulator fixes before anything compiles)
from ._env import SIMULATOR, NoCudaError, have_gpu
from .autotune import autotune
from .ops.flash_attn import flash_attn, flash_attn_varlen
from .ops.gemm import GemmConfig, gemm
from .ops.gemm_gated import deinterleave_gate_up, interleave_gate_up
from .ops.activations import gelu, gelu_and_mul, silu_and_mul
from .ops.embedding import embedding
from .ops.layer_norm import layer_norm
from .ops.paged_decode import paged_decode_attention
from .ops.paged_kv_append import paged_kv_append
from .ops.paged_prefill import paged_prefill_attention
from .ops.quant_gemm import quant_gemm
from .ops.quant_weight import QuantizedWeight, quantize_weight
from .ops.rms_norm import rms_norm
from .ops.rotary import rotary_embedding
from .ops.sample import sample
from .ops.argmax import argmax
from .ops.softmax import softmax
from .paged_cache import OutOfPages, PageAllocator, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "SIMULATOR", "have_gpu", "NoCudaError", "__version__",
    "gemm", "GemmConfig", "autotune", "interleave_gate_up", "deinterleave_gate_up",
    "flash_attn", "flash_attn_varlen",
    "rms_norm", "layer_norm", "rotary_embedding", "silu_and_mul", "gelu", "gelu_and_mul",
    "softmax", "argmax", "sample", "embedding",
    "quant_gemm", "quantize_weight", "QuantizedWeight",
    "paged_decode_attention", "paged_prefill_attention", "paged_kv_append", "PagedKVCache",
    "PageAllocator", "OutOfPages",
    "LLM", "SamplingParams", "RequestOutput",
]

_ENGINE_NAMES = ("LLM", "SamplingParams", "RequestOutput")


def __getattr__(name):
    # the engine needs torch: imported on first use, so the ops alone never import it
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'llmspeed_numba' has no attribute {name!r}")
