"""Input validation shared by every public op.

Checks run in a fixed order (type, rank, shape agreement, dtype, strides, supported sizes) and
raise real exceptions naming the argument with expected vs got:
``TypeError`` for non-arrays and dtypes, ``ValueError`` for shapes, layouts and ranges,
``NotImplementedError`` for valid but unsupported combinations.
"""

import math

import numpy as np

from . import _recording
from ._arrays import as_tensor, dtype_name


def tensor(x, name, ndim=None, dtypes=None):
    """Read ``x`` as a ``Tensor`` and check its rank and dtype."""
    t = as_tensor(x, name)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.ndim not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name}: expected {want} dimensions, got shape {t.shape}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {tuple(dtypes)}, got {t.dtype}")
    return t


def same_dtype(reference_name, reference, **others):
    """Every tensor in ``others`` has the dtype of ``reference``."""
    for name, t in others.items():
        if t is not None and t.dtype != reference.dtype:
            raise TypeError(f"{name}: expected dtype {reference.dtype} to match "
                            f"{reference_name}, got {t.dtype}")


def shape(name, t, expected, why=""):
    """``t.shape`` equals ``expected`` (None entries match anything)."""
    expected = tuple(expected)
    ok = len(t.shape) == len(expected) and all(
        e is None or e == g for e, g in zip(expected, t.shape))
    if not ok:
        shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + (
            ",)" if len(expected) == 1 else ")")
        raise ValueError(f"{name}: expected shape {shown}{' ' + why if why else ''}, "
                         f"got {t.shape}")


def bias_vector(bias, n, dtypes, why="(N,)"):
    """An optional ``bias`` argument: None, or a contiguous (n,) vector of one of ``dtypes``
    (its ``Tensor``)."""
    if bias is None:
        return None
    t = tensor(bias, "bias", ndim=1, dtypes=dtypes)
    shape("bias", t, (n,), why)
    if n > 1 and t.strides[0] != 1:
        raise ValueError(f"bias: expected a contiguous vector, got strides {t.strides}")
    return t


def result_dtype(out_dtype, out, default, allowed):
    """The library name of an op's ``out_dtype`` argument, one of ``allowed``: when None,
    ``out``'s dtype if ``out`` is given, else ``default``."""
    if out_dtype is None:
        out_dtype = tensor(out, "out", dtypes=allowed).dtype if out is not None else default
    out_dtype = dtype_name(out_dtype, "out_dtype")
    if out_dtype not in allowed:
        raise TypeError(f"out_dtype: expected one of {tuple(allowed)}, got {out_dtype!r}")
    return out_dtype


def last_dim_contiguous(name, t):
    if t.ndim and t.shape[-1] > 1 and t.strides[-1] != 1:
        raise ValueError(f"{name}: expected the last dimension to be contiguous (stride 1), "
                         f"got strides {t.strides}")


def contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous array, got shape {t.shape} with "
                         f"strides {t.strides}; call .contiguous() / ascontiguousarray first")


def non_negative_strides(name, t):
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")


def aligned(name, t, elements):
    """Pointer and every non-unit stride are multiples of ``elements`` (vector access)."""
    return t.ptr % (elements * t.itemsize) == 0 and all(
        s % elements == 0 for n, s in zip(t.shape, t.strides) if n > 1 and s != 1)


def output(name, out, expected_shape, expected_dtype, like):
    """Check a caller-provided ``out=`` (or return None to allocate one)."""
    if out is None:
        return None
    t = tensor(out, name)
    shape(name, t, expected_shape)
    if t.dtype != expected_dtype:
        raise TypeError(f"{name}: expected dtype {expected_dtype}, got {t.dtype}")
    non_negative_strides(name, t)
    return t


def one_of_dtypes(name, t, allowed, whose=None):
    """``t.dtype`` is in ``allowed`` (duplicates dropped); ``whose`` labels the first entry, e.g.
    ``"x's"`` in "expected dtype float16 (x's) or float32"."""
    allowed = tuple(dict.fromkeys(allowed))
    if t.dtype not in allowed:
        shown = [f"{d} ({whose})" if whose and i == 0 and len(allowed) > 1 else d
                 for i, d in enumerate(allowed)]
        raise TypeError(f"{name}: expected dtype {' or '.join(shown)}, got {t.dtype}")


def no_overlap(name, t, other_name, other):
    """``t`` and ``other`` (None allowed) share no memory: ``ValueError`` otherwise."""
    if other is None or t.size == 0 or other.size == 0:
        return
    t_bytes = t.extent() * t.itemsize
    o_bytes = other.extent() * other.itemsize
    _recording.note_overlap_check(t.obj, other.obj, t_bytes, o_bytes)
    t_end = t.ptr + t_bytes
    o_end = other.ptr + o_bytes
    if t.ptr < o_end and other.ptr < t_end:
        raise ValueError(f"{name}: expected an array that does not overlap {other_name}, got "
                         f"one sharing its memory")


def boolean(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {tuple(allowed)}, got {value!r}")


def softmax_scale(value, headdim):
    """Attention's softmax scale: ``1/sqrt(headdim)`` when None, else a finite number > 0."""
    if value is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(value).__name__}")
    scale = float(value)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale: expected a finite number > 0, got {scale}")
    return scale


def window_size(value):
    """A FlashAttention sliding window ``(left, right)``: ints, -1 meaning unbounded."""
    try:
        left, right = value
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got "
                        f"{value!r}") from None
    for name, w in (("window_size[0]", left), ("window_size[1]", right)):
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"{name}: expected -1 (unbounded) or a value >= 0, got {w}")
    return int(left), int(right)
