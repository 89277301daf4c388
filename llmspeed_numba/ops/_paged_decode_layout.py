"""Tiles and shared memory of the paged-decode kernel: the sizes its pieces share.

A block's dynamic shared memory holds one ring a warp, ``stages`` buffers of a key tile's K and
V (``TILE`` key rows of ``head_dim`` each), then (``q_smem``) the block's Q tile. At the end each
warp's ring is reused for its partial output, as float32 words (``_paged_decode_merge``).
"""

import functools

from .._env import cuda

#: Keys per tile: the n of two m16n8k16 score tiles and the k of one P V step.
TILE = 16

#: Head dimensions from which Q's A fragments are read from shared memory (``ldmatrix``) for every
#: tile instead of being kept in registers: at 256 the registers would spill.
Q_IN_SHARED_FROM = 256

#: Head dimensions whose K/V rings' rows are unpadded and swizzled (16-byte chunk ``c`` of row
#: ``r`` stored at chunk ``c ^ (r % 8)``): each 128-byte line of a key row lands in one 128-byte
#: line of shared memory, so a warp's cp.async asks the L2 for whole lines once. With the
#: 16-byte pad the lines straddle shared-memory lines and the L2 serves 1.5x the sectors, its
#: throughput the limit. Rows under 128 bytes (D < 64) have no whole line to keep; at D 256 the
#: 16 copy rounds' swizzled offsets, hoisted out of the tile loop, push the 2-warp kernel past
#: 255 registers (spills), so it keeps the pad.
SWIZZLE_DIMS = (64, 128)


def pitch(head_dim):
    """Row length (elements) of the Q tile and, outside ``SWIZZLE_DIMS``, of the K/V rings: the
    16-byte pad spreads the 8 rows one ldmatrix phase reads over 8 bank groups."""
    return head_dim + 8


def ring_pitch(head_dim):
    """Row length (elements) of the K/V rings: unpadded when swizzled."""
    return head_dim if head_dim in SWIZZLE_DIMS else pitch(head_dim)


def rows(m16):
    """Query rows of a block's tile: the M of one m16n8k16 mma (8: rows 8..15 are zero)."""
    return 16 if m16 else 8


def stage_elems(head_dim):
    """Elements of one ring buffer: a tile of K, then a tile of V."""
    return 2 * TILE * ring_pitch(head_dim)


def warp_elems(head_dim, stages):
    """Elements of one warp's ring (16-bit), from ``warp * warp_elems``."""
    return stages * stage_elems(head_dim)


def shared_bytes(head_dim, warps, stages, q_smem):
    """Dynamic shared memory of a block: the warps' K/V rings (and the Q tile)."""
    q_tile = 16 * pitch(head_dim) if q_smem else 0
    return (warps * warp_elems(head_dim, stages) + q_tile) * 2


@functools.lru_cache(maxsize=None)
def ring_offset(head_dim):
    """Device function ``(row, chunk) -> offset``: the element offset of 16-byte chunk
    ``chunk`` of row ``row`` in a K or V ring tile."""
    swizzle = head_dim in SWIZZLE_DIMS
    rp = ring_pitch(head_dim)

    @cuda.jit(device=True, inline="always")
    def ring_at(row, chunk):
        if swizzle:
            return row * rp + ((chunk ^ (row & 7)) << 3)
        return row * rp + (chunk << 3)

    return ring_at
