"""Type aliases of the public API (checked by mypy in CI).

Arrays are whatever the ops accept: numba device arrays, CuPy arrays, torch CUDA tensors, objects
with ``__cuda_array_interface__`` / ``__dlpack__``, and NumPy arrays under the simulator. No
common static type covers them, so ``ArrayLike`` is ``Any``; the ops check at run time.
"""

from typing import Any

#: An array an op reads or writes (see the module docstring); results are of the caller's kind.
ArrayLike = Any
#: None, a raw ``CUstream`` handle (int), or a numba / torch / CuPy / cuda.core stream.
StreamLike = Any
#: A dtype: a name ("float16", "bfloat16", "float32", ...), a NumPy / ml_dtypes or torch dtype.
DTypeLike = Any

__all__ = ["ArrayLike", "StreamLike", "DTypeLike"]
