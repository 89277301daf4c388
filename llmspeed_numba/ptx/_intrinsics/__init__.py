"""Inline-PTX implementations of the PTX op layer (the GPU backend), one module per instruction
family (``FAMILIES``); ``common.py`` holds what the families share.

Every op is a numba ``@intrinsic`` whose codegen emits one ``llvmlite.ir.InlineAsm`` (or a few
plain LLVM instructions), so it is inlined into the calling kernel without LTO and the kernel stays
cacheable on disk. ``_twins/`` holds the pure-Python versions with the same signatures, used by
the CUDA simulator, in modules of the same family names; ``ptx/__init__.py`` picks one set at
import.

Conventions shared by both backends:
- fp16 / bf16 data is stored and passed as raw ``uint16`` bits; two halves packed in a ``uint32``
  register hold the lower-indexed element in the low 16 bits (the PTX fragment convention).
- Memory operands are ``(array, offset)``: any numba array and an element offset from its data
  pointer (a flat index for C-contiguous arrays). Shared-memory operands must be arrays in shared
  memory; the op converts the generic pointer to a 32-bit shared address.
"""

from . import async_copy, convert, fast_math, memory, mma, sync, wgmma
from .async_copy import *  # noqa: F401,F403
from .convert import *  # noqa: F401,F403
from .fast_math import *  # noqa: F401,F403
from .memory import *  # noqa: F401,F403
from .mma import *  # noqa: F401,F403
from .sync import *  # noqa: F401,F403
from .wgmma import *  # noqa: F401,F403

#: The instruction families: ``_intrinsics/<family>.py`` lists its ops in its ``__all__``, and
#: ``_twins/<family>.py`` holds their simulator twins.
FAMILIES = (mma, wgmma, memory, async_copy, convert, fast_math, sync)

#: Every op of the PTX layer (``ptx.__all__``): the families' ops, in this order.
__all__ = [op for family in FAMILIES for op in family.__all__]


def _pin_identities():
    """Give every op a fixed identity for pickling. numba's disk cache keys a kernel on a
    pickle of its closure; an intrinsic pickles with a uuid drawn at first use, different in
    every process, so a kernel capturing an op (``mma = ptx.mma_bf16 if IS_BF16 else ...``)
    would never hit the cache. A name-derived id makes that pickle the same in every process."""
    for name in __all__:
        op = globals()[name]
        if getattr(op, "_Intrinsic__uuid", None) is None:
            op._set_uuid(f"llmspeed_numba.ptx.{name}")


_pin_identities()
