"""What the twin families share: the warp rendezvous of warp-collective twins (``_exchange``),
the f16 / bf16 bit helpers, and the condition variable and blocking wait of the barrier twins."""

import threading
import weakref

import numpy as np

_RENDEZVOUS_TIMEOUT_S = 120.0  # a lane that never arrives (exception, divergence) breaks the wait


class _Warp:
    def __init__(self, lanes):
        self.slots = [None] * lanes
        self.combined = None
        self.barrier = threading.Barrier(lanes, timeout=_RENDEZVOUS_TIMEOUT_S)


_warps_lock = threading.Lock()
_warps_by_block = weakref.WeakKeyDictionary()  # simulator BlockManager -> {warp index: _Warp}


def _lane_context():
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("warp-collective PTX twins must be called inside a simulated kernel")
    return thread, manager


def _exchange(value, combine=None):
    """Post ``value`` for this lane; return (lane, [value of every lane of the warp]), or with
    ``combine``, (lane, ``combine(values)``) computed once for the whole warp by its first lane
    (an mma's product, which every lane would otherwise rebuild)."""
    thread, manager = _lane_context()
    warp, lane = divmod(thread.thread_id, 32)
    with _warps_lock:
        warps = _warps_by_block.setdefault(manager, {})
        state = warps.get(warp)
        if state is None:
            threads_in_block = int(np.prod(manager._block_dim))
            state = warps[warp] = _Warp(min(32, threads_in_block - 32 * warp))
    state.slots[lane] = value
    state.barrier.wait()
    if combine is None:
        values = list(state.slots)
    elif lane == 0:
        try:
            state.combined = combine(list(state.slots))
        except Exception as exc:  # every lane raises it, none waits for a result
            state.combined = exc
    state.barrier.wait()  # nobody overwrites a slot (or the result) before every lane has read
    if combine is None:
        return lane, values
    if isinstance(state.combined, Exception):
        raise state.combined
    return lane, state.combined


# ---- bit helpers ---------------------------------------------------------------------------

def _bits16(x):
    return int(np.asarray(x).view(np.uint16)) if np.asarray(x).dtype.itemsize == 2 else int(x)


def _f16_bits_to_f32(bits):
    return float(np.uint16(bits).view(np.float16))


def _bf16_bits_to_f32(bits):
    return float(np.uint32(int(bits) << 16).view(np.float32))


def _f32_to_f16_bits(x):
    with np.errstate(over="ignore"):  # out-of-range values round to inf, as cvt.rn does
        return int(np.float16(np.float32(x)).view(np.uint16))


def _f32_to_bf16_bits(x):
    # round to nearest even, NaN kept quiet
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):
        return ((u >> 16) | 0x40) & 0xFFFF
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def _unpack(reg, to_f32):
    reg = int(reg)
    return to_f32(reg & 0xFFFF), to_f32((reg >> 16) & 0xFFFF)


# ---- barriers (mbarriers: ``async_copy``; named barriers: ``sync``) ------------------------
# One condition variable guards every barrier's state; a completed phase wakes all waiters,
# each re-checks its barrier.

_mbarrier_changed = threading.Condition()


def _blocking_wait(done, name, describe):
    """Wait for ``done()`` under ``_mbarrier_changed``: gives up when another simulated thread
    failed (the simulator sets ``abort``) or after the rendezvous timeout, a hang made an error."""
    thread = threading.current_thread()
    waited = 0.0
    with _mbarrier_changed:
        while not _mbarrier_changed.wait_for(done, 0.05):
            waited += 0.05
            if getattr(thread, "abort", False):
                raise RuntimeError(f"{name}: another thread of the block failed")
            if waited >= _RENDEZVOUS_TIMEOUT_S:
                raise RuntimeError(f"{name}: not done after {_RENDEZVOUS_TIMEOUT_S:.0f} s: "
                                   f"{describe()}")
