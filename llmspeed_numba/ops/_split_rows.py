"""Rows of the sampling ops (softmax, argmax) split over several blocks: the shared argument
checks and the split plan.

A few long rows (64 x 128256 logits, say) do not fill the GPU one block a row: each row is then
split over ``splits`` blocks of ``SPLIT_THREADS`` threads, grid (rows, splits), each block owning
a span of ``ceil(chunks / splits)`` chunks (``_rowwise`` layout). ``aim`` is the split count that
fills the GPU; ``resident_blocks`` what the GPU holds at once, which bounds it when a row's
blocks must run together (they wait for each other, or a second wave would only add merge work).
The planners read the tuning constants through ``TUNING`` (scope ``split_rows`` of
``_overrides.overrides``: tests shrink the launches to what the simulator runs quickly).
"""

import numpy as np

from .._checks import tensor
from .._env import SIMULATOR, cuda
from .._launch import array1d, collecting, sm_count
from .._overrides import Knobs
from . import _rowwise as rw

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
#: Threads per row when rows are split over several blocks.
SPLIT_THREADS = 512
#: 16-byte chunks each thread loads before using any (loads in flight per thread) when streaming.
UNROLL = 4
#: Blocks aimed for per SM when rows are split (at most what fits on the GPU at once).
BLOCKS_PER_SM = 4
#: A span of a split row is at least this many chunks per thread (amortises the partials).
MIN_CHUNKS_PER_THREAD = 4
#: Most blocks per row (softmax merges their partials through shared memory).
MAX_SPLITS = 256
#: The settings above that the planners read, overridable; ``resident_blocks``: blocks of a split
#: kernel the GPU holds at once (None: the occupancy of the compiled kernel, ``resident_blocks``;
#: under the simulator, which runs blocks one by one, 64).
TUNING = Knobs("split_rows", split_threads=SPLIT_THREADS, blocks_per_sm=BLOCKS_PER_SM,
               min_chunks_per_thread=MIN_CHUNKS_PER_THREAD,
               resident_blocks=64 if SIMULATOR else None)


def prepare(x, name="x"):
    """``(Tensor, rows, cols, row_stride)`` of a float ``(..., cols)`` input, checked: a
    non-empty, contiguous last dimension of fewer than 2^31 elements."""
    tx = tensor(x, name, dtypes=FLOAT_DTYPES)
    rows, cols, x_stride = rw.rows_view(name, tx)
    if cols == 0:
        raise ValueError(f"{name}: expected a non-empty last dimension, got shape {tx.shape}")
    if cols >= 2**31:
        raise NotImplementedError(f"{name}: rows of at most 2^31 - 1 elements, got {cols}")
    return tx, rows, cols, x_stride


def aim(rows, chunks, threads):
    """Blocks per row that fill the GPU: about ``BLOCKS_PER_SM`` blocks per SM in all, each span
    at least ``MIN_CHUNKS_PER_THREAD`` chunks a thread."""
    want = -(-TUNING.blocks_per_sm * sm_count() // max(rows, 1))
    most = max(1, chunks // (threads * TUNING.min_chunks_per_thread))
    return max(1, min(want, most, MAX_SPLITS))


_RESIDENT: dict = {}


def resident_blocks(kernel, threads):
    """Blocks of ``kernel`` (``threads`` each) the GPU holds at once: occupancy x SMs."""
    if TUNING.resident_blocks is not None:
        return TUNING.resident_blocks
    if collecting():  # the occupancy query compiles: the kernel is chosen already, so guess
        return 2 * sm_count()
    key = (cuda.get_current_device().id, kernel.name, id(kernel), threads)
    n = _RESIDENT.get(key)
    if n is None:
        n = _RESIDENT[key] = kernel.blocks_per_sm(threads) * sm_count()
    return n


def buffer_type(k):
    """The kernel parameter type of a buffer of storage kind ``k``."""
    return array1d(np.float32 if k == rw.KIND_F32 else np.uint16)
