"""The runtime's workspaces and placeholder buffers (``llmspeed_numba/_workspace.py``), on the
simulator (NumPy buffers): one buffer per (device, stream, name), zero when made, grown by at
least doubling with the replaced one kept (a CUDA graph may point at it) unless the op's eager
workspace is ``own_in_graph`` (no graph ever sees it)."""

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR, _workspace
from llmspeed_numba._arrays import as_tensor

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="NumPy workspaces: the simulator's")


@pytest.fixture
def like():
    return as_tensor(np.zeros(4, np.float32), "x")


def test_one_buffer_per_stream_and_name_zero_when_made(like):
    a = _workspace.workspace(like, 11, "test_ws_a", 10, np.int32)
    assert a.dtype == np.int32 and a.shape[0] >= 10 and not a.any()
    a[:3] = 7
    assert _workspace.workspace(like, 11, "test_ws_a", 5, np.int32) is a
    assert _workspace.workspace(like, 12, "test_ws_a", 5, np.int32) is not a
    assert _workspace.workspace(like, 11, "test_ws_b", 5, np.int32) is not a


@pytest.mark.parametrize("own_in_graph", [False, True])
def test_growth_doubles_and_keeps_what_a_graph_may_use(like, own_in_graph):
    name = f"test_ws_grow_{own_in_graph}"
    a = _workspace.workspace(like, 13, name, 10, np.float32, own_in_graph=own_in_graph)
    size = a.shape[0]
    retired = len(_workspace._RETIRED)
    b = _workspace.workspace(like, 13, name, size + 1, np.float32, own_in_graph=own_in_graph)
    assert b.shape[0] == 2 * size and not b.any()
    assert any(r is a for r in _workspace._RETIRED[retired:]) != own_in_graph


def test_unused_is_one_zero_element(like):
    for dtype in (np.float32, np.int32, np.uint16):
        u = _workspace.unused(like, dtype)
        assert u.shape == (1,) and u.dtype == dtype and not u.any()
