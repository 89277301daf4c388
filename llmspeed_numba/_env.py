"""Process-wide facts every module needs before it touches numba.

Import this module before ``numba.cuda`` is used anywhere in the package: it fixes the NumPy 2.5
incompatibility of numba-cuda 0.30.4, keeps numba-cuda's slow ml_dtypes import off the cold
start (``_LateMlDtypes``) and teaches the CUDA simulator the ``alignment=`` keyword of
``cuda.shared.array``, so kernels are written once for both targets.
"""

import importlib.abc
import os
import sys

import numpy as np

# numba-cuda 0.30.4 refers to np.row_stack, which NumPy 2.5 removed; every kernel compile fails
# without it (see shared/NUMBA_NOTES.md). vstack is the documented replacement.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

#: True when kernels run in numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), on a machine
#: with no GPU. Decided once, at import, exactly as numba decides it.
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


class _LateMlDtypes(importlib.abc.MetaPathFinder):
    """numba-cuda imports ml_dtypes, when installed, only to map NumPy's ml_dtypes bfloat16 to
    its own bfloat16 type. That import takes 0.3-0.6 s (NumPy registers each of its thousands of
    ufunc loops by a linear search), about half of a cold start. So while numba.cuda is imported
    ml_dtypes looks absent, unless it is loaded already; this one-shot finder then adds numba's
    mapping when ml_dtypes is first imported (by anyone, this library included), so numba behaves
    as if it had imported it itself."""

    def find_spec(self, name, path, target=None):
        if name != "ml_dtypes":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                _register_bfloat16(module)

            spec.loader.exec_module = exec_and_register
        return spec


def _register_bfloat16(ml_dtypes):
    """What numba-cuda's numpy_support does at import when ml_dtypes is there."""
    numpy_support = sys.modules.get("numba.cuda.np.numpy_support")
    if numpy_support is not None and getattr(numpy_support, "ml_dtypes", None) is None:
        numpy_support.ml_dtypes = ml_dtypes
        numpy_support.FROM_DTYPE[np.dtype(ml_dtypes.bfloat16)] = numpy_support.types.bfloat16


_DEFER_ML_DTYPES = "ml_dtypes" not in sys.modules and "numba.cuda" not in sys.modules
if _DEFER_ML_DTYPES:
    # None in sys.modules: importing ml_dtypes raises ImportError
    sys.modules["ml_dtypes"] = None  # type: ignore[assignment]
try:
    from numba import cuda  # noqa: E402  (after the NumPy fix above)
finally:
    if _DEFER_ML_DTYPES:
        del sys.modules["ml_dtypes"]
        sys.meta_path.insert(0, _LateMlDtypes())

if SIMULATOR:
    from numba.cuda.simulator import kernelapi as _kernelapi

    def _as_dtype(dtype):
        if isinstance(dtype, type):  # np.uint16 and friends, as accepted on the GPU
            return np.dtype(dtype)
        return dtype

    def _shared_array(self, shape, dtype, alignment=None):
        """The simulator's shared array plus ``alignment=``. Static arrays are keyed by the
        kernel's source line (as the simulator does), read here from the caller's frame: the
        simulator's own lookup would see this wrapper's line and alias every array."""
        dtype = _as_dtype(dtype)
        if shape == 0:
            return _original_shared_array(self, 0, dtype)
        if not isinstance(dtype, np.dtype):
            from numba.np import numpy_support

            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        array = self._allocations.get(key)
        if array is None:
            # setdefault is atomic: the block's threads reach this line concurrently, and a
            # get-then-store (the simulator's own) can hand two of them different arrays
            array = self._allocations.setdefault(key, np.empty(shape, dtype))
        return array

    def _local_array(self, shape, dtype, alignment=None):
        return _original_local_array(self, shape, _as_dtype(dtype))

    # Patch once (idempotent: the replacements are marked).
    if not getattr(_kernelapi.FakeCUDAShared.array, "_llmspeed_patched", False):
        _original_shared_array = _kernelapi.FakeCUDAShared.array
        _original_local_array = _kernelapi.FakeCUDALocal.array
        _shared_array._llmspeed_patched = True  # type: ignore[attr-defined]
        _local_array._llmspeed_patched = True  # type: ignore[attr-defined]
        _kernelapi.FakeCUDAShared.array = _shared_array  # type: ignore[method-assign]
        _kernelapi.FakeCUDALocal.array = _local_array  # type: ignore[method-assign]


_HAVE_GPU: list[bool] = []


def have_gpu() -> bool:
    """True when a real CUDA GPU is usable (never under the simulator). Asked once."""
    if SIMULATOR:
        return False
    if not _HAVE_GPU:
        try:
            _HAVE_GPU.append(bool(cuda.is_available() and len(cuda.gpus) > 0))
        except Exception:  # driver missing or broken: treat as no GPU
            _HAVE_GPU.append(False)
    return _HAVE_GPU[0]


#: What ops, ``PagedKVCache`` and ``info`` say on a machine without a usable GPU when the
#: simulator was not asked for.
NO_CUDA_MESSAGE = (
    "no CUDA driver/GPU found; to run on the CPU in numba's CUDA simulator, set "
    "NUMBA_ENABLE_CUDASIM=1 before importing llmspeed_numba (slow: see README)")


class NoCudaError(RuntimeError):
    """No usable CUDA GPU, and ``NUMBA_ENABLE_CUDASIM`` was not set before the import."""


def require_cuda() -> None:
    """Raise ``NoCudaError`` unless kernels can run (a GPU, or the simulator).

    numba fixes the target at import, from the environment, so the library cannot switch to the
    simulator itself once imported; importing still succeeds (``info``, ``compile-check`` and
    the references need no GPU), and the first thing that needs a device says how to proceed.
    """
    if not SIMULATOR and not have_gpu():
        raise NoCudaError(NO_CUDA_MESSAGE)


__all__ = ["SIMULATOR", "have_gpu", "cuda", "NO_CUDA_MESSAGE", "NoCudaError", "require_cuda"]
