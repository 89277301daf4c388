"""Pure-Python twins of the PTX op layer, for the CUDA simulator: ``_twins/<family>.py`` holds the
twins of the ops of ``_intrinsics/<family>.py``, same names, arguments and results; ``common.py``
what they share.

Warp-collective ops (mma, ldmatrix, shuffles) rendezvous the lanes of a warp: each simulated thread
is a Python thread, so every lane posts its operands, all wait on a barrier, each rebuilds the
whole fragment from the posted operands and takes its own part. The fragment layouts are the PTX
ISA's; the GPU tests that run one kernel on both targets tie these layouts to the hardware.
"""

from .._intrinsics import __all__  # noqa: F401  the op list: every op has its twin here
from .async_copy import *  # noqa: F401,F403
from .convert import *  # noqa: F401,F403
from .fast_math import *  # noqa: F401,F403
from .memory import *  # noqa: F401,F403
from .mma import *  # noqa: F401,F403
from .sync import *  # noqa: F401,F403
from .wgmma import *  # noqa: F401,F403
