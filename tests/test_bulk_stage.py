"""The producer / consumer staging kernel (``ops/bulk_stage.py``: mbarrier ring, 1-D bulk copies,
elect.sync, setmaxnreg) copies random data exactly, over several phases of each stage, with a
short last tile, and with the warp-specialised register split; a ring without its waits is
rejected. The GPU cases run benchmark-sized copies over many blocks and check that numba's own
link kept ``setmaxnreg`` (USETMAXREG in the SASS it loads).
"""

import numpy as np
import pytest

from llmspeed_numba import ptx
from llmspeed_numba._env import SIMULATOR
from llmspeed_numba.ops import bulk_stage

POISON = 0xDEADBEEF

# (tile, stages, chunks, consumer warps, maxnreg, n, grid): n a multiple of 4 (16-byte units)
SIM_CASES = [
    (64, 2, 2, 2, None, 7 * 64 - 12, 1),            # 7 tiles on 2 stages, the last one short
    (64, 2, 1, 4, bulk_stage.MAXNREG, 5 * 64 - 4, 1),  # producer / consumer warpgroups
    (32, 3, 2, 1, None, 11 * 32 + 8, 2),             # 3 stages, 2 blocks taking turns
]
GPU_CASES = [
    (2048, 2, 1, 4, None, (1 << 22) + 20, 132),
    (2048, 4, 4, 8, bulk_stage.MAXNREG, (1 << 22) + 4, 132),
    (4096, 3, 2, 8, bulk_stage.MAXNREG, (1 << 23) - 4096 + 36, 264),
    (256, 2, 2, 4, bulk_stage.MAXNREG, 4, 3),        # one short tile, blocks with nothing to do
]


def _ids(cases):
    return [f"t{c[0]}-s{c[1]}-c{c[2]}-w{c[3]}-{'split' if c[4] else 'warp'}-n{c[5]}-g{c[6]}"
            for c in cases]


def _stage(rng, tile, stages, chunks, consumer_warps, maxnreg, n, grid):
    src = rng.integers(0, 2**32, n, dtype=np.uint32)
    out = np.full(n, POISON, np.uint32)
    kernel = bulk_stage.staging_kernel(tile, stages, chunks, consumer_warps, maxnreg)
    kernel[grid, bulk_stage.threads_for(consumer_warps, maxnreg)](src, out, np.int32(n))
    return src, out, kernel


def _assert_copied(src, out):
    wrong = np.flatnonzero(src != out)
    assert wrong.size == 0, (f"{wrong.size} of {src.size} elements differ, first at {wrong[:8]}: "
                             f"got {out[wrong[:4]]}, expected {src[wrong[:4]]}")


@pytest.mark.parametrize("case", SIM_CASES, ids=_ids(SIM_CASES))
def test_staging_ring(case, rng):
    src, out, _ = _stage(rng, *case)
    _assert_copied(src, out)


@pytest.mark.skipif(not SIMULATOR, reason="replaces a PTX op by a Python no-op")
def test_ring_without_waits_is_rejected(rng, monkeypatch):
    """The deliberately wrong kernel: every mbarrier wait skipped, so consumers read stages
    before their copies land or after the next tile overwrote them."""
    monkeypatch.setattr(ptx, "mbarrier_wait_parity", lambda bar, offset, parity: None)
    src, out, _ = _stage(rng, *SIM_CASES[0])
    assert np.count_nonzero(src != out) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids(GPU_CASES))
def test_staging_ring_gpu(case, rng):
    src, out, kernel = _stage(rng, *case)
    _assert_copied(src, out)
    if case[4]:
        (sig,) = [s for s in kernel.overloads]
        try:
            sass = kernel.inspect_sass(sig)
        except Exception as exc:  # noqa: BLE001 - nvdisasm missing: the copy was checked
            pytest.skip(f"no SASS to read: {exc}")
        assert "USETMAXREG" in sass, "numba's link dropped setmaxnreg (see NOTES)"
