"""Shared test and benchmark helpers: random inputs, array conversion, derived tolerances and one
verbose closeness check. Float64 NumPy references of each op live beside the op's tests in
``llmspeed_numba/reference.py``.

Tolerances are derived, never guessed: a kernel's error against the float64 reference must be at
most ``factor`` (2) times the error of a plain same-precision implementation against the same
reference, plus a small allowance (``derived_check``).
"""

import numpy as np

from ._arrays import numpy_dtype, to_host
from ._env import SIMULATOR, cuda


def random_array(shape, dtype, rng, scale=1.0, low=None, high=None):
    """Host array of library dtype ``dtype`` (bfloat16 through ml_dtypes), never zeros."""
    if np.dtype(numpy_dtype(dtype)).kind in "iu":
        lo = 0 if low is None else low
        hi = 100 if high is None else high
        return rng.integers(lo, hi, size=shape).astype(numpy_dtype(dtype))
    x = rng.standard_normal(shape) * scale
    return x.astype(numpy_dtype(dtype))


def to_device(host, kind="numba"):
    """Put a host array on the device as ``kind``: numba, torch or cupy (simulator: numpy)."""
    if SIMULATOR or kind == "numpy":
        return np.ascontiguousarray(host)
    if host.dtype.name == "bfloat16":
        kind = "torch"  # numba and CuPy arrays cannot hold bfloat16
    if kind == "torch":
        import torch

        if host.dtype.name == "bfloat16":
            bits = torch.from_numpy(np.ascontiguousarray(host).view(np.uint16).astype(np.int16))
            return bits.view(torch.bfloat16).cuda()
        return torch.from_numpy(np.ascontiguousarray(host)).cuda()
    if kind == "cupy":
        import cupy

        return cupy.asarray(host)
    host = np.ascontiguousarray(host)
    if host.dtype == np.float16:  # numba's host<->device copy rejects the 'e' buffer format
        return cuda.to_device(host.view(np.uint16)).view(np.float16)
    return cuda.to_device(host)


def to_device_copy(host, kind, offset=0):
    """A fresh device copy of ``host`` as ``kind``; ``offset`` > 0 places it ``offset`` elements
    into a larger buffer, so its start is not 16-byte aligned (exercises scalar/unaligned
    kernel variants). Never shares memory with ``host``, also under the simulator."""
    if not offset:
        return to_device(np.array(host, copy=True), kind)
    flat = np.concatenate([np.ones(offset, host.dtype), np.ascontiguousarray(host).ravel()])
    return to_device(flat, kind)[offset:].reshape(host.shape)


def host_copy(x):
    """A host numpy copy of any supported array."""
    return np.array(to_host(x))


def f64(x):
    """Host float64 copy of any supported array."""
    return np.asarray(to_host(x)).astype(np.float64)


def poison(x):
    """Fill a device or host float array with NaN (so unwritten outputs are caught)."""
    mod = type(x).__module__
    if mod.startswith("torch") or mod.startswith("cupy"):
        x.fill_(float("nan")) if mod.startswith("torch") else x.fill(np.nan)
        return x
    if isinstance(x, np.ndarray):
        x[...] = np.nan
        return x
    host = to_host(x)
    host[...] = np.nan
    x.copy_to_device(host)
    return x


def rounded(x64, dtype):
    """Round a float64 array to ``dtype`` and back: what storing in that precision does."""
    return np.asarray(x64).astype(numpy_dtype(dtype)).astype(np.float64)


def describe_mismatch(got, expected, tolerance, name="output"):
    """Text of a failed closeness check: count, first indices, got vs expected, max errors."""
    got = np.asarray(got, np.float64)
    expected = np.asarray(expected, np.float64)
    err = np.abs(got - expected)
    bad = ~(err <= tolerance)  # NaN counts as bad
    idx = np.argwhere(bad)
    lines = [f"{name}: {int(bad.sum())} of {bad.size} elements differ by more than the tolerance"]
    for i in idx[:5]:
        t = tuple(int(v) for v in i)
        tol = tolerance[t] if np.ndim(tolerance) else tolerance
        lines.append(f"  at {t}: got {float(got[t])!r}, expected {float(expected[t])!r} "
                     f"(tolerance {float(tol):.3g})")
    finite = np.isfinite(err)
    if finite.any():
        rel = err[finite] / np.maximum(np.abs(expected[finite]), 1e-30)
        lines.append(f"  max abs error {err[finite].max():.4g}, max rel error {rel.max():.4g}")
    if (~np.isfinite(got)).any():
        lines.append(f"  {int((~np.isfinite(got)).sum())} non-finite values in the result "
                     "(NaN: never written, or a NaN produced)")
    return "\n".join(lines)


def assert_close(got, expected, atol, rtol=0.0, name="output"):
    """``|got - expected| <= atol + rtol * |expected|`` everywhere, with a verbose failure."""
    got = np.asarray(got, np.float64)
    expected = np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {got.shape} != expected {expected.shape}")
    tolerance = atol + rtol * np.abs(expected)
    err = np.abs(got - expected)
    both_inf = np.isinf(got) & np.isinf(expected) & (np.sign(got) == np.sign(expected))
    if not np.all((err <= tolerance) | both_inf):
        raise AssertionError(describe_mismatch(got, expected, tolerance, name))


def derived_check(got, reference64, plain, *, factor=2.0, allowance=1e-6, name="output"):
    """The kernel's max error vs the float64 reference is at most ``factor`` x the max error of
    ``plain`` (the same computation done simply in the kernel's precision) plus ``allowance``
    (scaled by the reference's magnitude). Returns the tolerance used."""
    reference64 = np.asarray(reference64, np.float64)
    plain_err = np.abs(np.asarray(plain, np.float64) - reference64)
    finite = np.isfinite(plain_err)
    base = plain_err[finite].max() if finite.any() else 0.0
    scale = np.abs(reference64[np.isfinite(reference64)]).max() if np.isfinite(
        reference64).any() else 1.0
    tolerance = factor * base + allowance * max(scale, 1.0)
    assert_close(got, reference64, tolerance, name=name)
    return tolerance
