"""The ops a model calls, on the model's torch tensors.

On a GPU these are the library's ops themselves (torch CUDA tensors in, torch out, no wrapper on
the hot path). Under the CUDA simulator the model's tensors live on the CPU, which the ops do not
take: each call passes zero-copy NumPy views (bfloat16 through ml_dtypes) and turns the NumPy
results back into torch tensors sharing their memory.
"""

import functools

import numpy as np

from .. import _env
from ..ops.activations import silu_and_mul
from ..ops.embedding import embedding
from ..ops.flash_attn import flash_attn_varlen
from ..ops.gemm import gemm
from ..ops.paged_decode import paged_decode_attention
from ..ops.paged_kv_append import paged_kv_append
from ..ops.paged_prefill import paged_prefill_attention
from ..ops.quant_gemm import quant_gemm, quant_gemm_rms_norm, stream_add_gemm, stream_norm_gemm
from ..ops.rms_norm import rms_norm
from ..ops.rotary import rotary_embedding
from ..ops.rotary_kv_append import rotary_kv_append
from ..ops.sample import sample
from ..ops.argmax import argmax

_OPS = {
    "argmax": argmax, "embedding": embedding, "flash_attn_varlen": flash_attn_varlen,
    "gemm": gemm, "paged_decode_attention": paged_decode_attention,
    "paged_kv_append": paged_kv_append, "paged_prefill_attention": paged_prefill_attention,
    "quant_gemm": quant_gemm, "quant_gemm_rms_norm": quant_gemm_rms_norm, "rms_norm": rms_norm,
    "rotary_embedding": rotary_embedding, "rotary_kv_append": rotary_kv_append,
    "sample": sample, "silu_and_mul": silu_and_mul, "stream_add_gemm": stream_add_gemm,
    "stream_norm_gemm": stream_norm_gemm,
}


def device():
    """The torch device a model's tensors live on: "cuda", or "cpu" under the simulator."""
    return "cpu" if _env.SIMULATOR else "cuda"


def _to_numpy(x):
    import torch

    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _to_torch(x):
    import torch

    if isinstance(x, tuple):
        return tuple(_to_torch(e) for e in x)
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _on_host(op):
    @functools.wraps(op)
    def call(*args, **kwargs):
        args = [_to_numpy(a) for a in args]
        kwargs = {k: _to_numpy(v) for k, v in kwargs.items()}
        return _to_torch(op(*args, **kwargs))

    return call


class Ops:
    """``ops.gemm(...)``, ``ops.rms_norm(...)``... for the model's tensors (see module doc)."""

    def __init__(self):
        for name, op in _OPS.items():
            setattr(self, name, _on_host(op) if _env.SIMULATOR else op)
