"""The PTX op layer: every inline-PTX operation of llmspeed_numba, in one place.

Kernels import this module and call ``ptx.<op>``. Which implementation they get is decided once,
at import:

- under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): the pure-Python twins (``_twins/``);
- on a GPU, by ``LLMSPEED_NUMBA_PTX_BACKEND``:
  ``intrinsic`` (default): ``@intrinsic`` + llvmlite ``InlineAsm`` (``_intrinsics/``), inlined
  without LTO, kernels stay cacheable;
  ``linked``: mma, ldmatrix and cp.async (``cp_async_16``; not the hinted ``cp_async_16_l2``)
  as CUDA C inline asm linked through ``cuda.declare_device`` and inlined by LTO
  (``_linked.py``); other ops stay intrinsics.

Both packages have one module per instruction family, of the same name (``_intrinsics/mma.py``,
``_twins/mma.py``: mma.sync and ldmatrix; ``wgmma``, ``memory``, ``async_copy``, ``convert``,
``fast_math``, ``sync``), and a ``common.py`` of shared helpers.

Data conventions (both backends): fp16/bf16 values travel as raw ``uint16`` bits, two of them
packed low-index-first in a ``uint32``; memory operands are ``(array, element_offset)``.

Fragment layouts of ``mma_f16`` / ``mma_bf16`` (m16n8k16, row.col, f32 accumulate), with
``g = lane // 4`` and ``t = lane % 4``:
  A (16x16): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]
  B (16x8):  b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
  C, D (16x8 f32): c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
``ldmatrix_x{1,2,4}``: lanes 8m..8m+7 give the row addresses (8 b16 each, 16-byte aligned) of
matrix m; register m of lane L holds row L//4, columns 2(L%4), 2(L%4)+1 (``_trans``: the same of
the transposed matrix).
"""

import os

from .._env import SIMULATOR

BACKENDS = ("intrinsic", "linked")

#: The backend in use: "simulator", "intrinsic" or "linked".
BACKEND = "simulator" if SIMULATOR else os.environ.get("LLMSPEED_NUMBA_PTX_BACKEND", "intrinsic")
if BACKEND not in BACKENDS + ("simulator",):
    raise ValueError(
        f"LLMSPEED_NUMBA_PTX_BACKEND: expected one of {BACKENDS}, got {BACKEND!r}")

if SIMULATOR:
    from ._twins import *  # noqa: F401,F403
else:
    from ._intrinsics import *  # noqa: F401,F403
    if BACKEND == "linked":
        from ._linked import *  # noqa: F401,F403  (overrides mma, ldmatrix, cp.async)

from ._intrinsics import __all__  # noqa: E402,F401  the op list is the same for every backend
