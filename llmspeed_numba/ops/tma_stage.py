"""Boxes of a 2-D tensor through the Tensor Memory Accelerator: the smallest kernel that uses a
tensor map (``_tensor_map.tensor_map_2d``) and ``ptx.cp_async_bulk_tensor_2d_g2s`` with an
mbarrier ring, the way a TMA producer of a GEMM or FlashAttention kernel would (issues 20, 22).

``boxes[t] = the box_rows x box_cols box t of src`` (row-major over the grid of boxes, the
elements outside ``src`` zeros), for 2-byte elements and 128-byte box rows (``box_cols`` 64)
in the 128-byte swizzle that wgmma's descriptors read. Per block (block b takes boxes b, b +
grid, ...):

- the producer, one elected thread of warp 0: waits until a ring stage is free (``empty[s]``),
  announces the box's bytes on ``full[s]`` and issues the one copy of the box;
- ``consumer_warps`` warps: wait for ``full[s]``, read the box out of its swizzled layout (the
  16-byte chunk c of box row r at chunk ``c ^ (r % 8)``) into ``boxes``, arrive on ``empty[s]``.

Not exported: a self-test of the PTX op and of the map's encoding (simulator and GPU tests,
compile check), like ``bulk_stage``.
"""

import functools

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._env import cuda
from .._launch import array1d, jit
from ._stage_ring import init_stage_barriers

ELEMENT_BYTES = 2
BOX_COLS = 128 // ELEMENT_BYTES   # one 128-byte swizzle row
_SWIZZLE_ALIGN = 1024             # the swizzle pattern follows shared address bits 7-9

_SIGNATURE = (array1d(np.uint64), array1d(np.uint16), types.int32, types.int32)


def threads_for(consumer_warps):
    return 32 * (1 + consumer_warps)


def staging_kernel_fn(box_rows, stages, consumer_warps):
    """The kernel function (not yet jitted): ``kernel[grid, threads_for(consumer_warps)](
    tensor_map, boxes, boxes_x, boxes_total)`` for a map with boxes of ``box_rows x BOX_COLS``
    (``box_rows`` a multiple of 8, so each stage starts 1024-byte aligned)."""
    if box_rows % 8 or not 8 <= box_rows <= 256:
        raise ValueError(f"box_rows: expected a multiple of 8 in [8, 256], got {box_rows}")
    box = box_rows * BOX_COLS
    consumer_threads = 32 * consumer_warps
    ring_elements = stages * box
    barriers = 2 * stages

    def tma_staging_kernel(tensor_map, boxes, boxes_x, boxes_total):
        ring = cuda.shared.array(ring_elements, np.uint16, alignment=_SWIZZLE_ALIGN)
        bars = cuda.shared.array(barriers, np.uint64)  # full[s] = bars[s], empty: stages + s
        tid = cuda.threadIdx.x
        init_stage_barriers(bars, stages, 1, consumer_threads, tid)
        first = cuda.blockIdx.x
        step = cuda.gridDim.x
        if tid < 32:
            if ptx.elect_sync():
                j = 0
                for t in range(first, boxes_total, step):
                    s = j % stages
                    ptx.mbarrier_wait_parity(bars, stages + s, ((j // stages) & 1) ^ 1)
                    ptx.mbarrier_arrive_expect_tx(bars, s, box * ELEMENT_BYTES)
                    by = t // boxes_x
                    ptx.cp_async_bulk_tensor_2d_g2s(ring, s * box, tensor_map,
                                                    (t - by * boxes_x) * BOX_COLS,
                                                    by * box_rows, bars, s)
                    j += 1
        else:
            ctid = tid - 32
            j = 0
            for t in range(first, boxes_total, step):
                s = j % stages
                ptx.mbarrier_wait_parity(bars, s, (j // stages) & 1)
                for i in range(ctid, box, consumer_threads):
                    r = i // BOX_COLS
                    c = i - r * BOX_COLS
                    chunk = (c // 8) ^ (r % 8)   # the swizzle: 8 chunks a row
                    boxes[t * box + i] = ring[s * box + r * BOX_COLS + chunk * 8 + c % 8]
                ptx.mbarrier_arrive(bars, stages + s)
                j += 1

    return tma_staging_kernel


@functools.cache
def staging_kernel(box_rows, stages, consumer_warps):
    """The jitted kernel (numba dispatcher) of one configuration."""
    return jit(staging_kernel_fn(box_rows, stages, consumer_warps))


def box_grid(rows, cols, box_rows):
    """(boxes along rows, boxes along columns) covering a ``rows x cols`` tensor."""
    return -(-rows // box_rows), -(-cols // BOX_COLS)


compile_check.register(
    "tma_stage", lambda: (staging_kernel_fn(64, 2, 4), _SIGNATURE),
    ptx_must_have=(("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx"
                    "::bytes"), "mbarrier.arrive.expect_tx.shared::cta.b64"),
    sass_must_have=("UTMALDG", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT"))
