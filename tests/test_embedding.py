"""embedding (row gather) against NumPy indexing: bit-exact, every dtype, aligned and not."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba.ops.embedding import embedding
from llmspeed_numba.testing import host_copy, poison, random_array, to_device_copy

KIND = "numpy" if SIMULATOR else "torch"
DTYPES = ["float16", "bfloat16", "float32"]


def _expected(weight, ids):
    rows = weight.shape[0]
    out = np.zeros((ids.size, weight.shape[1]), weight.dtype)
    inside = (ids >= 0) & (ids < rows)
    out[inside] = weight[ids[inside]]
    return out


def _case(rows, cols, n, dtype, id_dtype, rng, offset=0, out_of_range=False):
    weight = random_array((rows, cols), dtype, rng)
    ids = rng.integers(0, rows, size=n).astype(id_dtype)
    if out_of_range and n:
        ids[0], ids[-1] = -1, rows
    out = poison(to_device_copy(np.empty((n, cols), weight.dtype), KIND, offset))
    got = embedding(to_device_copy(ids, KIND), to_device_copy(weight, KIND, offset), out=out)
    assert got is out
    np.testing.assert_array_equal(host_copy(got).view(np.uint8),
                                  _expected(weight, ids).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_embedding_named_cases(dtype, offset):
    rng = np.random.default_rng(7)
    _case(11, 24, 5, dtype, np.int64, rng, offset=offset)
    _case(5, 3, 4, dtype, np.int32, rng, offset=offset, out_of_range=True)


@settings(max_examples=6)
@given(rows=st.integers(1, 40), cols=st.integers(1, 70), n=st.integers(0, 9),
       seed=st.integers(0, 2**16))
def test_embedding_hypothesis(rows, cols, n, seed):
    _case(rows, cols, n, "bfloat16", np.int64, np.random.default_rng(seed), out_of_range=True)


def test_embedding_allocates_in_weights_kind():
    rng = np.random.default_rng(1)
    weight = random_array((6, 16), "float16", rng)
    ids = np.array([5, 0, 2], np.int64)
    got = embedding(to_device_copy(ids, KIND), to_device_copy(weight, KIND))
    np.testing.assert_array_equal(host_copy(got), weight[ids])


def test_embedding_bad_input():
    rng = np.random.default_rng(2)
    weight = to_device_copy(random_array((6, 16), "float16", rng), KIND)
    ids = to_device_copy(np.array([1, 2], np.int64), KIND)
    with pytest.raises(TypeError, match="ids: expected dtype"):
        embedding(to_device_copy(np.array([1.0], np.float32), KIND), weight)
    with pytest.raises(TypeError, match="weight: expected dtype"):
        embedding(ids, to_device_copy(np.ones((2, 2), np.int32), KIND))
    with pytest.raises(ValueError, match="weight: expected 2 dimensions"):
        embedding(ids, to_device_copy(random_array((6,), "float16", rng), KIND))
    with pytest.raises(ValueError, match="ids: expected 1 dimensions"):
        embedding(to_device_copy(np.ones((2, 2), np.int64), KIND), weight)
    with pytest.raises(ValueError, match="out: expected shape"):
        embedding(ids, weight, out=to_device_copy(np.empty((3, 16), np.float16), KIND))
    with pytest.raises(TypeError, match="out: expected dtype"):
        embedding(ids, weight, out=to_device_copy(np.empty((2, 16), np.float32), KIND))
    with pytest.raises(TypeError, match="ids: expected a CUDA array"):
        embedding([1, 2], weight)
