"""The runtime's workspaces and placeholder buffers (``llmspeed_numba/_workspace.py``), on the
simulator (NumPy buffers): one buffer per (device, stream, name), zero when made, grown by at
least doubling with the replaced one kept (a CUDA graph may point at it) unless the op's eager
workspace is ``own_in_graph=True`` (no graph ever sees it); under capture (its id faked here),
``own_in_graph`` buffers per captured graph or per captured call."""

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


@pytest.mark.parametrize("own_in_graph", [False, True, "graph"])
def test_growth_doubles_and_keeps_what_a_graph_may_use(like, own_in_graph):
    name = f"test_ws_grow_{own_in_graph}"
    a = _workspace.workspace(like, 13, name, 10, np.float32, own_in_graph=own_in_graph)
    size = a.shape[0]
    retired = len(_workspace._RETIRED)
    b = _workspace.workspace(like, 13, name, size + 1, np.float32, own_in_graph=own_in_graph)
    assert b.shape[0] == 2 * size and not b.any()
    assert any(r is a for r in _workspace._RETIRED[retired:]) == (own_in_graph is not True)


def test_a_captured_graph_gets_buffers_of_its_own(monkeypatch):
    """Under capture, ``own_in_graph="graph"``: one zero buffer for all of a graph's calls (a
    bigger one when a later call needs more), another for the next graph, one per call when the
    capture cannot be told; ``True``: one per call. None of them is the eager workspace."""
    ids = iter([1, 1, 1, 2, None])
    monkeypatch.setattr(_workspace, "capture_id", lambda stream: next(ids))
    name = "test_ws_captured"

    def captured(size, own="graph"):
        return _workspace._captured(0, 21, name, size, np.int32, own)

    first = captured(10)
    assert first.shape[0] >= 10 and not first.any()
    assert captured(5) is first
    bigger = captured(4 * first.shape[0])
    assert bigger is not first and bigger.shape[0] >= 4 * first.shape[0] and not bigger.any()
    second_graph = captured(5)
    assert second_graph is not bigger and not second_graph.any()
    untold = captured(5)
    assert untold is not second_graph
    assert captured(5, own=True) is not untold
    assert _workspace._shared("torch", 0, 21, name, 5, np.int32, "graph") is not untold


def test_unused_is_one_zero_element(like):
    for dtype in (np.float32, np.int32, np.uint16):
        u = _workspace.unused(like, dtype)
        assert u.shape == (1,) and u.dtype == dtype and not u.any()
