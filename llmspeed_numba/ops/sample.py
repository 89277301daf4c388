"""Token sampling on the GPU: temperature, top-k, top-p (nucleus) and min-p, vLLM's conventions,
without sorting the vocabulary.

    greedy (temperature 0): token = argmax(logits[r])  (lowest index among ties, as ``argmax``)
    otherwise:              p = softmax(logits[r] / T), filtered, renormalised, one draw

Filters, applied in this order on the temperature-scaled distribution (each keeps an upper set of
logits, so the kept set is always "every logit >= some threshold"):
- top_k > 0 (and < vocab): keep every token whose logit is >= the k-th largest logit: ties at the
  boundary are all kept (as vLLM's ``apply_top_k_top_p``: ``logits < kth_value`` is masked);
- top_p < 1: on the top-k-renormalised distribution, keep token i when the mass of the tokens with
  a strictly larger logit is < top_p (the sorted-cumsum rule of vLLM / torch, "keep while the mass
  before the token is < top_p", with tokens of equal logits kept or dropped together; the most
  likely token is always kept);
- min_p > 0: keep tokens with p >= min_p * p_max (independent of renormalisation).

Layout: ``logits`` (rows, vocab) fp16 / bf16 / fp32, last dimension contiguous (any row stride);
per-row parameters are scalars or device arrays of shape (rows,) (temperature / top_p / min_p
float32, top_k int32, seed int64) read by the kernel, so a captured CUDA graph replays with new
values. Output int64 (rows,).

Randomness: one 53-bit uniform per row, ``u = splitmix64(seed)``: a row's token depends only on its
logits, its parameters and its seed - not on the batch, its row index or the array layout - and
is the same on every run and every GPU. A scalar seed is every row's seed (two rows with equal
logits then draw the same token): pass a seed per row for independent rows.

Kernel (``_sample_kernel.py``): one block a row, reading the row in passes (argmax; for top-k /
top-p a histogram of logit deficits, then a radix select inside the threshold bin; the draw), with
integer (fixed-point) sums so that the result is the same bits on every run.

Invalid per-row array values are not checked on the device (that would need a host sync): they
give unspecified tokens, never an access outside the arrays (temperature <= 0 or NaN is greedy,
top_k <= 0 or >= vocab and top_p >= 1 or NaN are off, top_p <= 0 keeps the top tokens, min_p > 1
acts as 1).
"""

import math

import numpy as np

from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import output, tensor
from .._env import SIMULATOR
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from .._workspace import unused
from . import _rowwise as rw
from . import _sample_kernel as sk
from ._sample_kernel import (_K_ARRAY, _MINP_ARRAY, _P_ARRAY, _SEED_ARRAY, _T_ARRAY,
                             _sample_kernel, threads_for)

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
#: Histogram bins and radix digit bits: the kernel's, or under the simulator, whose cost is per
#: Python operation, smaller (the thresholds are exact for any sizes: they only trade histogram
#: work against passes; tests run both).
BINS, DIGIT_BITS = (64, 6) if SIMULATOR else (sk.BINS, sk.DIGIT_BITS)
#: What the launcher reads, overridable (scope ``sample`` of ``_overrides.overrides``: tests run
#: the GPU's histogram sizes under the simulator too).
TUNING = Knobs("sample", bins=BINS, digit_bits=DIGIT_BITS)
#: Largest vocabulary (fixed-point sums stay below 2^63).
MAX_VOCAB = 2**23


# ---- host side ----------------------------------------------------------------------------------

def _param(name, value, rows, dtype, like, kind_ok, check):
    """``(scalar, array buffer, is_array)`` of one parameter: a Python scalar (checked by
    ``check``) or a device array (rows,) of ``dtype``."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {kind_ok[1]} or a {dtype} array of shape ({rows},), "
                        f"got bool")
    if isinstance(value, kind_ok[0]):
        check(value)
        return value, unused(like, dtype), False
    try:
        tv = tensor(value, name)
    except TypeError:
        raise TypeError(f"{name}: expected {kind_ok[1]} or a {dtype} array of shape ({rows},), "
                        f"got {type(value).__name__}") from None
    if tv.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {tv.dtype}")
    if tv.shape != (rows,):
        raise ValueError(f"{name}: expected shape ({rows},) (one value a row of logits), got "
                         f"{tv.shape}")
    if rows > 1 and tv.strides[0] != 1:
        raise ValueError(f"{name}: expected a contiguous array, got strides {tv.strides}")
    return 0, kernel_buffer(tv), True


_FLOAT = ((int, float, np.floating, np.integer), "a float")
_INT = ((int, np.integer), "an int")


def _check_temperature(v):
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"temperature: expected a finite float >= 0, got {v}")


def _check_top_k(v):
    if v < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0: off), got {v}")


def _check_top_p(v):
    if not (0 < v <= 1):
        raise ValueError(f"top_p: expected a float in (0, 1], got {v}")


def _check_min_p(v):
    if not (0 <= v <= 1):
        raise ValueError(f"min_p: expected a float in [0, 1], got {v}")


def _check_seed(v):
    if not (-2**63 <= v < 2**64):
        raise ValueError(f"seed: expected a 64-bit int, got {v}")


_SAMPLE_CALLS = OpCalls("sample")


def sample(logits: ArrayLike, *, temperature: float | ArrayLike = 1.0,
           top_k: int | ArrayLike = 0, top_p: float | ArrayLike = 1.0,
           min_p: float | ArrayLike = 0.0, seed: int | ArrayLike = 0,
           out: ArrayLike | None = None, stream: StreamLike = None) -> ArrayLike:
    """Sample one token per row of ``logits`` (vLLM's sampling parameters), on the GPU.

    Args:
        logits: (rows, vocab) fp16 / bf16 / fp32, last dimension contiguous.
        temperature: float >= 0 (0: greedy, the argmax) or a float32 array (rows,).
        top_k: int >= 0 (0: off; keeps every logit >= the k-th largest, ties included) or an
            int32 array (rows,).
        top_p: float in (0, 1] (1: off) or a float32 array (rows,).
        min_p: float in [0, 1] (0: off) or a float32 array (rows,).
        seed: int (every row's seed) or an int64 array (rows,). The token of a row depends only
            on its logits, its parameters and its seed.
        out: optional int64 (rows,).
        stream: CUDA stream (default: the caller's framework's current stream).

    Filters apply in the order top_k, top_p (on the top-k-renormalised distribution), min_p, on
    softmax(logits / temperature); the draw is from the renormalised kept set. Array parameters
    are not range-checked (no host sync): invalid values give unspecified tokens, never an
    out-of-bounds access. Rows whose max is NaN or +-inf return their argmax.

    Returns:
        ``out``: int64 token ids (rows,), in logits' array kind.

    Raises:
        TypeError: non-arrays, unsupported dtypes, parameters of the wrong type or dtype,
            ``out`` not int64.
        ValueError: logits not 2-D, an empty vocabulary, a non-contiguous last dimension,
            parameter arrays or ``out`` of the wrong shape, scalars out of range.
        NotImplementedError: a vocabulary over 2^23.
    """
    result = _SAMPLE_CALLS.replay(
        (logits, temperature, top_k, top_p, min_p, seed, out),
        (), stream)
    if result is MISS:
        result = _SAMPLE_CALLS.record(
            _sample_checked, logits, temperature, top_k, top_p, min_p, seed, out, stream)
    return result


def _sample_checked(logits, temperature, top_k, top_p, min_p, seed, out, stream):
    """The checked path of ``sample`` (validation, planning, launch)."""
    tx = tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    rows, cols = tx.shape
    if cols == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary, got shape {tx.shape}")
    if rows and cols > 1 and tx.strides[1] != 1:
        raise ValueError(f"logits: expected the last dimension to be contiguous (stride 1), got "
                         f"strides {tx.strides}")
    if cols > MAX_VOCAB:
        raise NotImplementedError(f"logits: a vocabulary of at most 2^23, got {cols}")
    temp_s, temps, t_arr = _param("temperature", temperature, rows, "float32", tx, _FLOAT,
                                  _check_temperature)
    top_k_s, top_ks, k_arr = _param("top_k", top_k, rows, "int32", tx, _INT, _check_top_k)
    top_p_s, top_ps, p_arr = _param("top_p", top_p, rows, "float32", tx, _FLOAT, _check_top_p)
    min_p_s, min_ps, mp_arr = _param("min_p", min_p, rows, "float32", tx, _FLOAT, _check_min_p)
    seed_s, seeds, s_arr = _param("seed", seed, rows, "int64", tx, _INT, _check_seed)
    to = output("out", out, (rows,), "int64", tx)
    if to is None:
        out = empty(tx, (rows,), "int64")
        to = tensor(out, "out")
    if rows == 0:
        return out
    x_stride = tx.strides[0] if rows > 1 else cols
    o_stride = to.strides[0] if rows > 1 else 1
    arrays = (_T_ARRAY * t_arr | _K_ARRAY * k_arr | _P_ARRAY * p_arr | _MINP_ARRAY * mp_arr
              | _SEED_ARRAY * s_arr)
    seed_s = int(seed_s)
    if seed_s >= 2**63:
        seed_s -= 2**64  # the same 64 bits, as the kernel's int64
    k = rw.kind(tx.dtype)
    vector = rw.vector_aligned(tx, 0 if rows == 1 else x_stride, rw.vector_width(tx.dtype))
    threads = threads_for(cols)
    _sample_kernel(k, vector, threads, TUNING.bins, TUNING.digit_bits)(
        rows, threads,
        (kernel_buffer(tx), kernel_buffer(to), temps, top_ks, top_ps, min_ps, seeds,
         float(temp_s), min(int(top_k_s), 2**31 - 1), float(top_p_s), float(min_p_s), seed_s,
         arrays, cols, x_stride, o_stride),
        stream_handle(stream, (tx,)))
    return out

