"""Tensor maps and the TMA copy (``_tensor_map.tensor_map_2d``, ``ptx.cp_async_bulk_tensor_2d_g2s``,
through ``ops/tma_stage.py``'s mbarrier ring): every box of a random matrix comes back exactly,
swizzled and read back, with the elements past the matrix's edges zero; a strided (sliced)
matrix; the ring wrapping over several phases per stage; the map's input checks. The GPU cases
check the driver's encoding and the hardware copy on larger matrices over many blocks.
"""

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR, have_gpu
from llmspeed_numba._arrays import as_tensor
from llmspeed_numba._tensor_map import tensor_map_2d
from llmspeed_numba.ops import tma_stage

POISON = 0xBEEF

gpu = pytest.mark.skipif(SIMULATOR or not have_gpu(),
                         reason="needs a CUDA GPU: part of the GPU suite (pytest -m gpu)")


def _device(a):
    if SIMULATOR:
        return a
    from numba import cuda

    return cuda.to_device(a)


def _expected_boxes(src, box_rows):
    rows, cols = src.shape
    by, bx = tma_stage.box_grid(rows, cols, box_rows)
    padded = np.zeros((by * box_rows, bx * tma_stage.BOX_COLS), src.dtype)
    padded[:rows, :cols] = src
    return padded.reshape(by, box_rows, bx, tma_stage.BOX_COLS).transpose(0, 2, 1, 3).reshape(
        by * bx, box_rows * tma_stage.BOX_COLS)


def _copy_boxes(src_device, shape, box_rows, stages, consumer_warps, grid):
    rows, cols = shape
    tmap = tensor_map_2d(as_tensor(src_device, "src"), box_rows, tma_stage.BOX_COLS)
    by, bx = tma_stage.box_grid(rows, cols, box_rows)
    boxes = _device(np.full(by * bx * box_rows * tma_stage.BOX_COLS, POISON, np.uint16))
    kernel = tma_stage.staging_kernel(box_rows, stages, consumer_warps)
    tmap = getattr(tmap, "owner", tmap)   # the GPU's map: a Buffer; the dispatcher takes its array
    kernel[grid, tma_stage.threads_for(consumer_warps)](tmap, boxes, np.int32(bx),
                                                        np.int32(by * bx))
    out = boxes if SIMULATOR else boxes.copy_to_host()
    return out.reshape(by * bx, box_rows * tma_stage.BOX_COLS)


def _assert_boxes(got, expected):
    wrong = np.argwhere(got != expected)
    assert wrong.size == 0, (f"{len(wrong)} of {expected.size} elements differ, first (box, "
                             f"element) {wrong[:4].tolist()}: got {got[tuple(wrong[0])]}, "
                             f"expected {expected[tuple(wrong[0])]}")


def _check_random_boxes(case, rng):
    rows, cols, box_rows, stages, warps, grid = case
    src = rng.integers(0, 2**16, (rows, cols), dtype=np.uint16)
    got = _copy_boxes(_device(src), src.shape, box_rows, stages, warps, grid)
    _assert_boxes(got, _expected_boxes(src, box_rows))


# (rows, cols, box_rows, stages, consumer warps, grid)
SIM_CASES = [
    (37, 152, 16, 2, 2, 2),    # ragged in both dimensions: zero fill; 9 boxes over 2 stages
    (8, 64, 8, 2, 1, 1),       # one whole box
    (70, 64, 8, 3, 1, 1),      # 9 boxes, one block: each stage through three phases
]
GPU_CASES = [
    (4096, 4096, 64, 4, 4, 132),
    (1000, 1000, 128, 3, 8, 64),
    (37, 152, 16, 2, 2, 2),
]


@pytest.mark.skipif(not SIMULATOR, reason="simulator cases (the GPU ones: test_gpu_tma_boxes)")
@pytest.mark.parametrize("case", SIM_CASES, ids=str)
def test_tma_boxes(case, rng):
    _check_random_boxes(case, rng)


@pytest.mark.skipif(not SIMULATOR, reason="simulator case (the GPU one is test_gpu_tma_strided)")
def test_tma_strided_rows(rng):
    """A column slice of a wider matrix: the map's row stride is the parent's."""
    parent = rng.integers(0, 2**16, (24, 200), dtype=np.uint16)
    src = parent[:, 8:8 + 96]
    got = _copy_boxes(src, src.shape, 8, 2, 1, 1)
    _assert_boxes(got, _expected_boxes(np.ascontiguousarray(src), 8))


def test_tensor_map_input_checks():
    a = _device(np.zeros((16, 64), np.uint16))
    t = as_tensor(a, "a")
    with pytest.raises(ValueError, match="box: a row must be"):
        tensor_map_2d(t, 8, 32)                 # 64-byte rows with the 128-byte swizzle
    with pytest.raises(ValueError, match="box: expected 1-256"):
        tensor_map_2d(t, 512, 64)
    with pytest.raises(ValueError, match="swizzle"):
        tensor_map_2d(t, 8, 64, swizzle=64)
    with pytest.raises(ValueError, match="2-D"):
        tensor_map_2d(as_tensor(_device(np.zeros(64, np.uint16)), "v"), 8, 64)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        tensor_map_2d(as_tensor(_device(np.zeros((16, 60), np.uint16)), "odd"), 8, 64)
    with pytest.raises(ValueError, match="box_rows: expected a multiple of 8"):
        tma_stage.staging_kernel_fn(12, 2, 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_tma_boxes(case, rng):
    _check_random_boxes(case, rng)


@pytest.mark.gpu
@gpu
def test_gpu_tma_strided(rng):
    from numba import cuda

    host = rng.integers(0, 2**16, (300, 512), dtype=np.uint16)
    src = cuda.to_device(host)[:, 64:64 + 320]
    got = _copy_boxes(src, src.shape, 32, 2, 4, 16)
    _assert_boxes(got, _expected_boxes(host[:, 64:64 + 320], 32))


def test_map_cache_drops_the_least_recently_used_and_keeps_pinned_maps():
    """Device maps stay bounded (a server's varlen totals change every step): past the capacity
    the least recently used map goes; a map looked up during a graph capture (``pin``) stays for
    good, since the captured graph keeps reading its buffer."""
    from llmspeed_numba._tensor_map import MapCache

    made = []

    def maker(key):
        def make(asked):
            assert asked == key
            made.append(key)
            return f"map {key}"
        return make

    cache = MapCache(3)
    for key in "abc":
        assert cache.get(key, maker(key), pin=False) == f"map {key}"
    assert cache.get("a", maker("a"), pin=False) == "map a"   # a hit refreshes "a"
    cache.get("d", maker("d"), pin=False)                      # drops "b", the oldest
    assert made == list("abcd") and len(cache) == 3
    assert cache.get("b", None, pin=False) is None             # gone; not made without make
    assert cache.get("c", None, pin=True) == "map c"           # found during a capture: pinned
    for key in "efgh":
        cache.get(key, maker(key), pin=False)
    assert cache.get("c", None, pin=False) == "map c"          # outlived four newer maps
    assert cache.get("a", None, pin=False) is None
    assert len(cache) == 4 and made == list("abcdefgh")
