"""The prologue shared by the row-wise op tests (norms, activations, rotary, softmax, argmax):
the dtypes, the array kind the tests run on, device / host copies, and the mark for tests of
special values."""

import pytest

from llmspeed_numba import SIMULATOR
from llmspeed_numba._overrides import overrides
from llmspeed_numba.testing import host_copy, to_device_copy

DTYPES = ["float16", "bfloat16", "float32"]
#: The array kind the ops get: NumPy arrays under the simulator, torch tensors on a GPU.
KIND = "numpy" if SIMULATOR else "torch"
#: For rows of special values only: the simulator does device arithmetic in NumPy, which reports
#: the IEEE operations (-inf - -inf, inf + -inf, 1 / 0) that give those rows their documented
#: results (a GPU reports nothing). Other tests keep warnings as errors (pyproject's
#: filterwarnings).
IEEE_SPECIALS = pytest.mark.filterwarnings(
    "ignore:.*(invalid value|divide by zero) encountered:RuntimeWarning")


def dev(host_array, offset=0):
    """A device copy of ``host_array`` in ``KIND``, starting ``offset`` elements into its
    allocation (``offset=1``: misaligned for 16-byte access)."""
    return to_device_copy(host_array, KIND, offset)


host = host_copy


def split_rows(split, **more):
    """The ``overrides`` of softmax / argmax launches: ``split`` forces rows over several
    blocks, else one block a row; under the simulator also small enough to run there. ``more``:
    further scopes (``softmax={"splits": 4}``)."""
    if not SIMULATOR:
        return overrides(split_rows={"blocks_per_sm": 64 if split else 0}, **more)
    return overrides(rowwise={"min_block_threads": 32, "target_chunks_per_thread": 8},
                     split_rows={"split_threads": 8, "min_chunks_per_thread": 1,
                                 "blocks_per_sm": 8 if split else 0}, **more)
