"""The ``dtype`` argument of the loaders: a torch dtype or its name."""

from .._arrays import dtype_name

_NAMES = ("float32", "float16", "bfloat16")


def torch_dtype(dtype):
    """``torch.float32`` / ``float16`` / ``bfloat16`` from itself or its name ("bfloat16").

    Raises TypeError for anything else, ValueError for another dtype."""
    import torch

    if isinstance(dtype, str):
        if dtype not in _NAMES:
            raise ValueError(f"dtype: expected one of {', '.join(_NAMES)}, got {dtype!r}")
        return getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch dtype or its name, got {type(dtype).__name__}")
    if dtype_name(dtype, "dtype") not in _NAMES:
        raise ValueError(f"dtype: expected torch.float32, float16 or bfloat16, got {dtype}")
    return dtype
