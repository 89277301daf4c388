"""Twins of ``_intrinsics/async_copy.py``: cp.async, mbarriers and bulk copies."""

import threading

import numpy as np

from .._intrinsics.async_copy import L2_PREFETCH_SIZES, MBARRIER_MAX_COUNT
from .common import _blocking_wait, _mbarrier_changed

# ---- cp.async (a plain copy here; commit / wait have nothing to wait for) ------------------

def cp_async_16(smem, smem_offset, gmem, gmem_offset, src_bytes):
    itemsize = smem.dtype.itemsize
    count = 16 // itemsize
    if gmem.dtype != smem.dtype:  # the bytes, as the hardware copies them
        data = np.zeros(16, np.uint8)
        valid = int(src_bytes)
        if valid:
            src = [gmem[gmem_offset + i] for i in range(valid // gmem.dtype.itemsize)]
            data[:valid] = np.array(src, dtype=gmem.dtype).view(np.uint8)
        for i, v in enumerate(data.view(smem.dtype)):
            smem[smem_offset + i] = v
        return
    valid = int(src_bytes) // gmem.dtype.itemsize
    for i in range(count):
        smem[smem_offset + i] = gmem[gmem_offset + i] if i < valid else 0


def cp_async_16_l2(smem, smem_offset, gmem, gmem_offset, src_bytes, prefetch):
    if prefetch not in L2_PREFETCH_SIZES:  # as the GPU build rejects it
        raise TypeError(f"cp_async_16_l2: prefetch must be one of {L2_PREFETCH_SIZES}, got "
                        f"{prefetch}")
    cp_async_16(smem, smem_offset, gmem, gmem_offset, src_bytes)  # the hint moves no data


def cp_async_commit():
    pass


def cp_async_wait(n):
    pass


# ---- Hopper mbarriers and bulk copies ------------------------------------------------------
# An mbarrier twin keeps its state in the barrier's own 8-byte word of shared memory, as the
# hardware does (the encoding is the twin's: the hardware's is opaque), so barriers carved from
# dynamic shared memory, aliases and per-block copies behave as on the GPU. One condition
# variable (``common._mbarrier_changed``) guards every word; a completed phase wakes all
# waiters, each re-checks its barrier.
# The bulk copy is a plain copy made when it is issued, then its bytes complete on the barrier.

_TRY_WAIT_S = 0.002        # a try_wait suspends the thread a little, as the hardware's may
_FIELD = (1 << 21) - 1     # word: pending 0-20, expected 21-41, tx + 2**20 42-62, parity 63
_TX_BIAS = 1 << 20


def _words(bar, offset, name):
    array = np.asarray(getattr(bar, "_ary", bar))
    if array.dtype.itemsize != 8 or array.dtype.kind not in "iu":
        raise TypeError(f"{name}: the mbarrier must be an element of an 8-byte integer array in "
                        f"shared memory (uint64 or int64), got dtype {array.dtype}")
    words = array.reshape(-1).view(np.uint64)
    index = int(offset)
    if not 0 <= index < words.size:
        raise IndexError(f"{name}: mbarrier offset {index} is outside the array of "
                         f"{words.size}")
    return words, index


def _decode(word):
    word = int(word)
    return (word & _FIELD, (word >> 21) & _FIELD, ((word >> 42) & _FIELD) - _TX_BIAS,
            word >> 63)


def _encode(pending, expected, tx, parity):
    return np.uint64(pending | (expected << 21) | ((tx + _TX_BIAS) << 42) | (parity << 63))


def _mbarrier_update(bar, offset, arrivals, tx_delta, name):
    """Apply arrivals and a transaction-count change; complete the phase when both reach zero.
    Returns the parity of the phase they were applied to."""
    words, i = _words(bar, offset, name)
    with _mbarrier_changed:
        pending, expected, tx, parity = _decode(words[i])
        if expected == 0:
            raise RuntimeError(f"{name}: the mbarrier at offset {i} is not initialised "
                               "(mbarrier_init, then fence_mbarrier_init and syncthreads)")
        pending -= arrivals
        tx += tx_delta
        if pending < 0:
            raise RuntimeError(f"{name}: more arrivals than the mbarrier's count ({expected}) "
                               f"in one phase (offset {i})")
        if not -_TX_BIAS <= tx < _TX_BIAS:
            raise RuntimeError(f"{name}: transaction count {tx} out of range (offset {i})")
        if pending == 0 and tx == 0:
            words[i] = _encode(expected, expected, 0, parity ^ 1)
            _mbarrier_changed.notify_all()
        else:
            words[i] = _encode(pending, expected, tx, parity)
        return parity


def _check_bytes(nbytes, name, what="nbytes"):
    n = int(nbytes)
    if not 0 <= n <= MBARRIER_MAX_COUNT:
        raise ValueError(f"{name}: {what} must be in [0, {MBARRIER_MAX_COUNT}], got {n}")
    return n


def mbarrier_init(bar, offset, count):
    n = int(count)
    if not 1 <= n <= MBARRIER_MAX_COUNT:
        raise ValueError(f"mbarrier_init: count must be in [1, {MBARRIER_MAX_COUNT}], got {n}")
    words, i = _words(bar, offset, "mbarrier_init")
    with _mbarrier_changed:
        words[i] = _encode(n, n, 0, 0)


def fence_mbarrier_init():
    pass


def mbarrier_arrive(bar, offset):
    return np.uint64(_mbarrier_update(bar, offset, 1, 0, "mbarrier_arrive"))


def cp_async_mbarrier_arrive_noinc(bar, offset):
    # this thread's cp.async copies were made when issued: its arrival is due at once
    _mbarrier_update(bar, offset, 1, 0, "cp_async_mbarrier_arrive_noinc")


def mbarrier_arrive_expect_tx(bar, offset, nbytes):
    n = _check_bytes(nbytes, "mbarrier_arrive_expect_tx")
    return np.uint64(_mbarrier_update(bar, offset, 1, n, "mbarrier_arrive_expect_tx"))


def mbarrier_expect_tx(bar, offset, nbytes):
    _mbarrier_update(bar, offset, 0, _check_bytes(nbytes, "mbarrier_expect_tx"),
                     "mbarrier_expect_tx")


def _phase_done(words, i, parity):
    return _decode(words[i])[3] != parity


def _check_parity(parity, name):
    p = int(parity)
    if p not in (0, 1):
        raise ValueError(f"{name}: parity must be 0 or 1, got {p}")
    return p


def _try_wait(words, i, parity, name):
    if getattr(threading.current_thread(), "abort", False):  # a kernel's retry loop ends too
        raise RuntimeError(f"{name}: another thread of the block failed")
    with _mbarrier_changed:
        return _mbarrier_changed.wait_for(lambda: _phase_done(words, i, parity), _TRY_WAIT_S)


def mbarrier_try_wait_parity(bar, offset, parity):
    p = _check_parity(parity, "mbarrier_try_wait_parity")
    words, i = _words(bar, offset, "mbarrier_try_wait_parity")
    return _try_wait(words, i, p, "mbarrier_try_wait_parity")


def mbarrier_try_wait(bar, offset, token):
    words, i = _words(bar, offset, "mbarrier_try_wait")
    return _try_wait(words, i, int(token) & 1, "mbarrier_try_wait")


def mbarrier_wait_parity(bar, offset, parity):
    p = _check_parity(parity, "mbarrier_wait_parity")
    words, i = _words(bar, offset, "mbarrier_wait_parity")

    def describe():
        pending, expected, tx, current = _decode(words[i])
        return (f"the phase of parity {p} of the mbarrier at offset {i} never completed "
                f"(current parity {current}: {pending} of {expected} arrivals and {tx} "
                "transaction bytes pending; a missing arrive, expect_tx or copy)")

    _blocking_wait(lambda: _phase_done(words, i, p), "mbarrier_wait_parity", describe)


def _byte_view(array, offset, nbytes, name, what):
    host = np.asarray(getattr(array, "_ary", array))
    if not host.flags.c_contiguous:
        raise ValueError(f"{name}: {what} must be contiguous")
    start = int(offset) * host.dtype.itemsize
    address = host.ctypes.data + start
    if address % 16:
        raise ValueError(f"{name}: {what} address must be 16-byte aligned, element offset "
                         f"{int(offset)} is at address {address:#x}")
    flat = host.reshape(-1).view(np.uint8)
    if start < 0 or start + nbytes > flat.size:
        raise IndexError(f"{name}: {what} bytes [{start}, {start + nbytes}) are outside the "
                         f"array of {flat.size} bytes")
    return flat[start:start + nbytes]


def cp_async_bulk_g2s(smem, smem_offset, gmem, gmem_offset, nbytes, bar, bar_offset):
    name = "cp_async_bulk_g2s"
    n = int(nbytes)
    if n <= 0 or n % 16 or n > MBARRIER_MAX_COUNT:
        raise ValueError(f"{name}: nbytes must be a positive multiple of 16 of at most "
                         f"{MBARRIER_MAX_COUNT}, got {n}")
    dst = _byte_view(smem, smem_offset, n, name, "smem")
    dst[:] = _byte_view(gmem, gmem_offset, n, name, "gmem")
    _mbarrier_update(bar, bar_offset, 0, -n, name)


# ---- the Tensor Memory Accelerator: the twin of a tensor map is an entry of this table, whose
# key the map's buffer holds (``_tensor_map.tensor_map_2d`` under the simulator) ------------

class TwinTensorMap:
    """What a 2-D tensor map encodes: the tensor (a flat numpy view of its storage), its rows,
    columns and row stride (elements), the box (rows, columns) and the swizzle span in bytes (0:
    none, 128: the 16-byte chunks of each 128-byte row XOR-ed with address bits 7-9)."""

    def __init__(self, flat, rows, cols, row_stride, box_rows, box_cols, swizzle):
        self.flat, self.rows, self.cols, self.row_stride = flat, rows, cols, row_stride
        self.box_rows, self.box_cols, self.swizzle = box_rows, box_cols, swizzle


TWIN_TENSOR_MAPS = {}
_TWIN_KEYS = iter(range(1, 1 << 62))


def register_tensor_map(entry):
    """A new key for ``entry`` (the twin's side of ``tensor_map_2d``)."""
    key = next(_TWIN_KEYS)
    TWIN_TENSOR_MAPS[key] = entry
    return key


def cp_async_bulk_tensor_2d_g2s(smem, smem_offset, tensor_map, x, y, bar, bar_offset):
    name = "cp_async_bulk_tensor_2d_g2s"
    entry = TWIN_TENSOR_MAPS.get(int(np.asarray(tensor_map).reshape(-1).view(np.uint64)[0]))
    if entry is None:
        raise ValueError(f"{name}: tensor_map is not a map made by tensor_map_2d")
    x, y = int(x), int(y)
    item = entry.flat.dtype.itemsize
    row_bytes = entry.box_cols * item
    nbytes = entry.box_rows * row_bytes
    align = 1024 if entry.swizzle else 128
    start = int(smem_offset) * np.asarray(getattr(smem, "_ary", smem)).dtype.itemsize
    if start % align:
        raise ValueError(f"{name}: the shared destination must be {align}-byte aligned, byte "
                         f"offset {start}")
    dst = _byte_view(smem, smem_offset, nbytes, name, "smem")
    box = np.zeros((entry.box_rows, entry.box_cols), entry.flat.dtype)
    r0, r1 = max(y, 0), min(y + entry.box_rows, entry.rows)
    c0, c1 = max(x, 0), min(x + entry.box_cols, entry.cols)
    for r in range(r0, r1):
        if c0 < c1:
            base = r * entry.row_stride
            box[r - y, c0 - x:c1 - x] = entry.flat[base + c0:base + c1]
    raw = box.reshape(-1).view(np.uint8)
    if entry.swizzle:
        address = start + np.arange(nbytes)
        chunk_moved = address ^ (((address >> 7) & 7) << 4)
        dst[chunk_moved - start] = raw
    else:
        dst[:] = raw
    _mbarrier_update(bar, bar_offset, 0, -nbytes, name)
