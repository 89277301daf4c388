"""The one-warp cp.async -> ldmatrix -> mma tile product over several K, and its input checks."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from llmspeed_numba.ops.warp_tile import warp_tile_matmul
from llmspeed_numba.testing import f64, poison, random_array, to_device, to_host


def _expected_and_bound(a, b):
    a64, b64 = f64(a), f64(b)
    k_total = a64.shape[1]
    # halves' products are exact in fp32; the fp32 sums round: |err| <= K eps32 sum |a||b|
    bound = k_total * np.finfo(np.float32).eps * (np.abs(a64) @ np.abs(b64))
    return a64 @ b64, bound


@given(k_steps=st.integers(1, 6), tail=st.sampled_from([0, 8]),
       dtype=st.sampled_from(["float16", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_warp_tile_matches_float64(k_steps, tail, dtype, seed):
    rng = np.random.default_rng(seed)
    k_total = 16 * k_steps - tail          # K = 8 mod 16 exercises the zero-filled last step
    a = random_array((16, k_total), dtype, rng)
    b = random_array((k_total, 8), dtype, rng)
    out = poison(to_device(np.empty((16, 8), np.float32)))
    got = to_host(warp_tile_matmul(to_device(a), to_device(b), out=out))
    expected, bound = _expected_and_bound(a, b)
    assert np.all(np.abs(got - expected) <= bound)


def test_warp_tile_bad_inputs(rng):
    a = to_device(random_array((16, 32), "float16", rng))
    b = to_device(random_array((32, 8), "float16", rng))
    with pytest.raises(TypeError, match="a: expected a CUDA array"):
        warp_tile_matmul([[1.0]], b)
    with pytest.raises(ValueError, match=r"b: expected shape \(32, 8\)"):
        warp_tile_matmul(a, to_device(random_array((16, 8), "float16", rng)))
    with pytest.raises(TypeError, match="b: expected dtype float16"):
        warp_tile_matmul(a, to_device(random_array((32, 8), "bfloat16", rng)))
    with pytest.raises(TypeError, match="a: expected dtype in"):
        warp_tile_matmul(to_device(random_array((16, 32), "float32", rng)), b)
    with pytest.raises(ValueError, match="a: expected 2 dimensions"):
        warp_tile_matmul(to_device(random_array((16, 32, 1), "float16", rng)), b)
    with pytest.raises(ValueError, match="positive multiple of 8"):
        warp_tile_matmul(to_device(random_array((16, 12), "float16", rng)),
                         to_device(random_array((12, 8), "float16", rng)))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["numba", "torch"])
def test_gpu_replay_path_new_pointers(kind, rng):
    """Repeated calls of one signature replay the recorded launch with each call's pointers
    (new arrays every call, out poisoned): every result is that call's own product; a numba
    call without out allocates through the checked path; mixed kinds are not replayed."""
    from numba import cuda

    from llmspeed_numba.ops import warp_tile

    def place(x):
        return cuda.to_device(x) if kind == "numba" else to_device(x, "torch")

    recorded = len(warp_tile._WARP_TILE_CALLS.plans)
    for _ in range(3):
        a = random_array((16, 40), "float16", rng)
        b = random_array((40, 8), "float16", rng)
        out = poison(place(np.empty((16, 8), np.float32)))
        got = warp_tile_matmul(place(a), place(b), out=out)
        assert got is out
        expected, bound = _expected_and_bound(a, b)
        assert np.all(np.abs(to_host(got) - expected) <= bound)
        got = warp_tile_matmul(place(a), place(b))
        assert type(got).__module__.startswith(kind)
        assert np.all(np.abs(to_host(got) - expected) <= bound)
    assert len(warp_tile._WARP_TILE_CALLS.plans) > recorded
    mixed = warp_tile_matmul(cuda.to_device(a), to_device(b, "torch"))
    assert np.all(np.abs(to_host(mixed) - expected) <= bound)
