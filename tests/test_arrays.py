"""Array interop, validation helpers and the launcher, under the simulator and on a GPU."""

import numpy as np
import pytest

from llmspeed_numba import _checks
from llmspeed_numba._arrays import as_tensor, kernel_buffer, stream_handle
from llmspeed_numba._env import SIMULATOR, cuda
from llmspeed_numba.testing import assert_close, derived_check, random_array, to_device


def test_tensor_reads_layout_without_copy(rng):
    host = random_array((6, 10), "float32", rng)
    x = to_device(host, "numpy" if SIMULATOR else "torch")  # numba's .T copies; these view
    t = as_tensor(x, "x")
    assert (t.shape, t.strides, t.dtype) == ((6, 10), (10, 1), "float32")
    tt = as_tensor(x.T, "x")
    assert (tt.shape, tt.strides) == ((10, 6), (1, 10))
    assert tt.ptr == t.ptr and not tt.is_contiguous()


def test_bfloat16_tensor(rng):
    t = as_tensor(to_device(random_array((3, 4), "bfloat16", rng)), "q")
    assert t.dtype == "bfloat16" and t.itemsize == 2


@pytest.mark.skipif(not SIMULATOR, reason="buffers are numpy views only under the simulator")
def test_kernel_buffer_covers_the_strided_extent(rng):
    host = random_array((4, 6, 8), "float16", rng)
    sliced = host[:, 1:5, :]                   # last dim contiguous, other strides not
    buf = kernel_buffer(as_tensor(sliced, "q"))
    assert buf.dtype == np.uint16
    assert buf.size == (4 - 1) * 48 + (4 - 1) * 8 + 8
    assert buf[0] == sliced[0, 0, 0].view(np.uint16)


def test_non_arrays_are_rejected():
    with pytest.raises(TypeError, match=r"x: expected a CUDA array .* got list"):
        as_tensor([1, 2, 3], "x")
    with pytest.raises(TypeError, match="x: unsupported dtype"):
        as_tensor(to_device(np.zeros(3, np.complex64)), "x")


def test_checks_name_the_argument(rng):
    t = as_tensor(to_device(random_array((2, 3), "float16", rng)), "k")
    with pytest.raises(ValueError, match=r"k: expected 3 dimensions, got shape \(2, 3\)"):
        _checks.tensor(to_device(random_array((2, 3), "float16", rng)), "k", ndim=3)
    with pytest.raises(ValueError, match=r"k: expected shape \(2, 4\) to match q, got \(2, 3\)"):
        _checks.shape("k", t, (2, 4), "to match q")
    with pytest.raises(ValueError, match="stream"):
        _checks.choice("stream", "x", ("a",))


def test_stream_handles():
    assert stream_handle(None) == 0
    assert stream_handle(1234) == 1234
    with pytest.raises(TypeError, match="stream: expected"):
        stream_handle(object())


def test_closeness_check_reports_and_rejects():
    expected = np.linspace(-1, 1, 50)
    assert_close(expected + 1e-9, expected, atol=1e-8)
    bad = expected.copy()
    bad[7] = np.nan
    with pytest.raises(AssertionError, match=r"(?s)1 of 50 .* at \(7,\).*non-finite"):
        assert_close(bad, expected, atol=1e-3)
    # a deliberately wrong implementation (fp16 rounding of an fp32 result) is rejected
    plain32 = expected.astype(np.float32)
    with pytest.raises(AssertionError):
        derived_check(expected.astype(np.float16), expected, plain32, allowance=0.0)
    derived_check(plain32, expected, plain32)


@pytest.mark.gpu
def test_torch_and_cupy_round_trip_kinds(rng):
    torch = pytest.importorskip("torch")
    from llmspeed_numba.ops.warp_tile import warp_tile_matmul

    a = random_array((16, 64), "bfloat16", rng)
    b = random_array((64, 8), "bfloat16", rng)
    out = warp_tile_matmul(to_device(a, "torch"), to_device(b, "torch"))
    assert isinstance(out, torch.Tensor) and out.is_cuda
    cupy = pytest.importorskip("cupy")
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    out_cp = warp_tile_matmul(cupy.asarray(a16), cupy.asarray(b16))
    assert isinstance(out_cp, cupy.ndarray)
    out_nb = warp_tile_matmul(cuda.to_device(a16), cuda.to_device(b16))
    assert cuda.is_cuda_array(out_nb) and type(out_nb).__module__.startswith("numba")
    np.testing.assert_allclose(out_cp.get(), out_nb.copy_to_host(), rtol=0, atol=0)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's shared arrays")
def test_simulator_gives_a_block_one_shared_array(monkeypatch):
    """Threads of a block that reach ``cuda.shared.array`` together all get the same array
    (a get-then-store lookup handed racing threads arrays of their own: garbage read across
    threads, seen once the simulator switched threads often)."""
    import threading
    import time

    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared(0)
    real_empty = np.empty

    def slow_empty(*args, **kwargs):  # every thread finds no array before any stores one
        time.sleep(0.02)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slow_empty)
    found = []
    threads = [threading.Thread(target=lambda: found.append(shared.array(16, np.float32)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 8 and all(a is found[0] for a in found)
