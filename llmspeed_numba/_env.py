"""Process-wide facts every module needs before it touches numba.

Import this module before ``numba.cuda`` is used anywhere in the package: it fixes the NumPy 2.5
incompatibility of numba-cuda 0.30.4 and teaches the CUDA simulator the ``alignment=`` keyword of
``cuda.shared.array``, so kernels are written once for both targets.
"""

import os

import numpy as np

# numba-cuda 0.30.4 refers to np.row_stack, which NumPy 2.5 removed; every kernel compile fails
# without it (see shared/NUMBA_NOTES.md). vstack is the documented replacement.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

#: True when kernels run in numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), on a machine
#: with no GPU. Decided once, at import, exactly as numba decides it.
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

from numba import cuda  # noqa: E402  (after the NumPy fix above)

if SIMULATOR:
    from numba.cuda.simulator import kernelapi as _kernelapi

    def _accept_alignment(array_fn):
        def array(self, shape, dtype, alignment=None):
            if isinstance(dtype, type):  # np.uint16 and friends, as accepted on the GPU
                dtype = np.dtype(dtype)
            return array_fn(self, shape, dtype)

        return array

    # The simulator's shared/local arrays are numpy arrays, aligned well enough; it only lacks
    # the keyword. Patch once (idempotent: the wrapper is marked).
    for _cls in (_kernelapi.FakeCUDAShared, _kernelapi.FakeCUDALocal):
        if not getattr(_cls.array, "_llmspeed_patched", False):
            _cls.array = _accept_alignment(_cls.array)
            _cls.array._llmspeed_patched = True


def have_gpu() -> bool:
    """True when a real CUDA GPU is usable (never under the simulator)."""
    if SIMULATOR:
        return False
    try:
        return cuda.is_available() and len(cuda.gpus) > 0
    except Exception:  # driver missing or broken: treat as no GPU
        return False


__all__ = ["SIMULATOR", "have_gpu", "cuda"]
