"""llmspeed_numba: LLM-inference GPU kernels written in Python with Numba CUDA.

Ops take numba device arrays, CuPy arrays or PyTorch CUDA tensors (no copies) and return results
in the caller's kind. Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in numba's CUDA
simulator, on NumPy arrays.
"""

from . import _env  # noqa: F401  (NumPy / simulator fixes before anything compiles)
from ._env import SIMULATOR, have_gpu
from .ops.warp_tile import warp_tile_matmul

__version__ = "0.1.0"

__all__ = ["SIMULATOR", "have_gpu", "warp_tile_matmul", "__version__"]
