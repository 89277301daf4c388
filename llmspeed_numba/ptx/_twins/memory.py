"""Twins of ``_intrinsics/memory.py``: 16-byte vector access and shared-window addresses."""

import numpy as np

# ---- 16-byte vector access -----------------------------------------------------------------

def _as_bytes(array, offset):
    itemsize = array.dtype.itemsize
    return np.array([array[offset + i] for i in range(16 // itemsize)], dtype=array.dtype), itemsize


def load_u32x4(array, offset):
    data, _ = _as_bytes(array, offset)
    words = data.view(np.uint32)
    return tuple(np.uint32(w) for w in words)


def store_u32x4(array, offset, v0, v1, v2, v3):
    words = np.array([v0, v1, v2, v3], dtype=np.uint32).view(array.dtype)
    for i, w in enumerate(words):
        array[offset + i] = w


# ---- shared-window addresses ---------------------------------------------------------------

def shared_address(smem, offset):
    # the simulator's shared arrays start at address 0: 1024-byte aligned, as a real kernel
    # arranges its swizzled tiles to be
    return np.uint32(int(offset) * smem.dtype.itemsize)
