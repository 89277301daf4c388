"""32-bit index arithmetic for kernels.

Numba types ``int // int`` as a 64-bit signed division, which the GPU runs as a subroutine call
(``__cuda_sm20_div_s64``); a kernel that divides a dozen indices in a chain (decoding the block
index, rows into (token, head)) pays for each in its prologue. Indices known to be below 2^32
divide as ``div.u32`` instead, a short inline sequence.
"""

import numpy as np

from .._env import cuda


@cuda.jit(device=True, inline="always")
def udiv(n, d):
    """``n // d`` for ``0 <= n < 2**32`` and ``0 < d < 2**32`` (a 32-bit unsigned division),
    as an int64."""
    return np.int64(np.uint32(n) // np.uint32(d))
