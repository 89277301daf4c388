"""Twins of ``_intrinsics/sync.py``: warp shuffles, syncwarp, elect, named barriers,
setmaxnreg, griddepcontrol."""

import weakref

import numpy as np

from .._intrinsics.sync import SETMAXNREG_RANGE
from .common import _blocking_wait, _exchange, _lane_context, _mbarrier_changed

# ---- warp collectives ----------------------------------------------------------------------

def shfl_xor_f32(value, lane_mask):
    lane, values = _exchange(np.float32(value))
    return np.float32(values[lane ^ int(lane_mask)])


def shfl_xor_i32(value, lane_mask):
    lane, values = _exchange(np.int32(value))
    return np.int32(values[lane ^ int(lane_mask)])


def shfl_idx_i32(value, src_lane):
    lane, values = _exchange(np.int32(value))
    return np.int32(values[int(src_lane) % 32])


def vote_any(predicate):
    _, values = _exchange(bool(predicate))
    return any(values)


def syncwarp():
    _exchange(None)


def elect_sync():
    lane, _ = _exchange(None)
    return lane == 0


# ---- named barriers and warpgroup register reallocation ------------------------------------

class _NamedBarrier:
    def __init__(self):
        self.arrived = 0
        self.generation = 0
        self.count = None


_named_barriers = weakref.WeakKeyDictionary()  # simulator BlockManager -> {(block, id): state}


def _named_barrier(barrier_id, count, name):
    i, n = int(barrier_id), int(count)
    if not 0 <= i < 16:
        raise ValueError(f"{name}: barrier_id must be in [0, 15], got {i}")
    if n <= 0 or n % 32:
        raise ValueError(f"{name}: count must be a positive multiple of 32 (whole warps), "
                         f"got {n}")
    thread, manager = _lane_context()
    with _mbarrier_changed:
        states = _named_barriers.setdefault(manager, {})
        state = states.setdefault((tuple(thread.blockIdx), i), _NamedBarrier())
        if state.count not in (None, n):
            raise RuntimeError(f"{name}: barrier {i} used with counts {state.count} and {n} in "
                               "one phase")
        state.count = n
        generation = state.generation
        state.arrived += 1
        if state.arrived == n:
            state.arrived, state.count = 0, None
            state.generation += 1
            _mbarrier_changed.notify_all()
    return state, generation


def named_barrier_sync(barrier_id, count):
    state, generation = _named_barrier(barrier_id, count, "named_barrier_sync")
    _blocking_wait(lambda: state.generation != generation, "named_barrier_sync",
                   lambda: f"barrier {int(barrier_id)}: {state.arrived} of {int(count)} "
                   "threads arrived")


def named_barrier_arrive(barrier_id, count):
    _named_barrier(barrier_id, count, "named_barrier_arrive")


def _setmaxnreg(count, name):
    low, high = SETMAXNREG_RANGE
    if int(count) % 8 or not low <= int(count) <= high:  # as the GPU build rejects it
        raise TypeError(f"{name}: count must be a multiple of 8 in [{low}, {high}], got "
                        f"{count}")


def setmaxnreg_inc(count):
    _setmaxnreg(count, "setmaxnreg_inc")


def setmaxnreg_dec(count):
    _setmaxnreg(count, "setmaxnreg_dec")


# ---- programmatic dependent launch -----------------------------------------------------------
# The simulator runs launches one after another: every earlier grid has completed.

def griddep_wait():
    pass


def griddep_launch_dependents():
    pass
