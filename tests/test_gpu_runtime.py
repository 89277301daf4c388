"""GPU-only runtime behaviour of the launch layer (GPU suite; skipped under the simulator).

Covers: capture of library launches in a CUDA graph and correct replay (also with every ticket
and counter workspace left dirty between replays); the linked PTX backend
giving bit-identical results to the intrinsic backend; more than 48 KB of dynamic shared memory
through the automatic opt-in; the on-disk kernel cache being used by a second process; a
programmatic dependent launch waiting for the kernel before it (eagerly and in a CUDA graph).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import types

from llmspeed_numba._env import cuda
from llmspeed_numba.testing import f64, random_array, to_device, to_host

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_ops_captured_in_a_cuda_graph_replay_correctly(rng):
    torch = pytest.importorskip("torch")
    from llmspeed_numba.ops.warp_tile import warp_tile_matmul

    a = to_device(random_array((16, 256), "float16", rng), "torch")
    b = to_device(random_array((256, 8), "float16", rng), "torch")
    b2 = to_device(random_array((256, 8), "float16", rng), "torch")
    warp_tile_matmul(a, b)
    warp_tile_matmul(a, b2)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out1 = warp_tile_matmul(a, b)
        out2 = warp_tile_matmul(a, b2)
    out1.fill_(float("nan"))
    out2.fill_(float("nan"))
    a.copy_(to_device(random_array((16, 256), "float16", rng), "torch"))  # new data, same buffer
    graph.replay()
    torch.cuda.synchronize()
    for out, bb in ((out1, b), (out2, b2)):
        expected = f64(a) @ f64(bb)
        bound = 256 * np.finfo(np.float32).eps * (np.abs(f64(a)) @ np.abs(f64(bb)))
        assert np.all(np.abs(to_host(out) - expected) <= bound)


#: workspaces that must be zero when a kernel starts (each kernel leaves them zero)
_ZERO_STATE = ("gemm_split_tickets", "argmax_keys", "argmax_tickets", "softmax_counts",
               "attention_tiles", "quant_gemm_tickets")


def test_graph_replays_do_not_depend_on_counters_left_dirty(rng):
    """Graphs sharing a memory pool use each other's freed memory as scratch on replay, so a
    ticket or counter buffer made inside one capture can be left dirty by another graph's replay
    (the engine's wrong greedy token at 99a8acf). Split-K gemm, split argmax, split softmax, a
    quantized projection with the next norm fused (its split and norm tickets) and (on Hopper)
    the persistent attention kernel's tile counter captured into two graphs of one pool; before
    each replay every such buffer the workspace module holds (eager, and the graphs' own) is
    filled with ones: each replay still gives the eager results, bit for bit."""
    torch = pytest.importorskip("torch")
    from llmspeed_numba import (_workspace, argmax, flash_attn, gemm, quant_gemm_rms_norm,
                                quantize_weight, softmax)
    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops.flash_attn import WGMMA_CONFIGS
    from llmspeed_numba.ops.gemm_configs import wgmma_supported

    a = to_device(random_array((8, 4096), "bfloat16", rng), "torch")      # split K at M 8
    b = to_device(random_array((4096, 1024), "bfloat16", rng), "torch")
    x = to_device(random_array((2, 49152), "float32", rng), "torch")      # split rows
    q, k, v = (to_device(random_array((2, 300, 4, 64), "bfloat16", rng), "torch")
               for _ in range(3))
    persistent = {"impl": "wgmma", "config": WGMMA_CONFIGS[64] + (0, 0, 1), "tma_min_work": 0}
    qw = quantize_weight(to_device(random_array((2048, 4096), "bfloat16", rng), "torch"), "int4")
    h = to_device(random_array((1, 4096), "bfloat16", rng), "torch")
    start = to_device(random_array((1, 2048), "bfloat16", rng), "torch")
    residual = start.clone()
    norm_w = to_device(random_array((2048,), "bfloat16", rng), "torch")

    def work():
        residual.copy_(start)     # the fused norm adds into it: every run from the same start
        with overrides(quant_gemm={"fused_norm_max_m": 1}):   # fused: off by default
            outs = (gemm(a, b), argmax(x), softmax(x),
                    quant_gemm_rms_norm(h, qw, residual, norm_w))
        if wgmma_supported():
            with overrides(flash_attn=persistent):
                outs += (flash_attn(q, k, v, causal=True),)
        return outs

    expected = work()
    torch.cuda.synchronize()
    graphs, pool = [], None
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outs = work()
        pool = graph.pool()
        graphs.append((graph, outs))

    buffers = [buf for key, buf in _workspace._WORKSPACE.items() if key[2] in _ZERO_STATE]
    buffers += [buf for name, buf in _workspace.captured_buffers() if name in _ZERO_STATE]
    assert buffers
    try:
        for _ in range(2):
            for graph, outs in graphs:
                for out in outs:
                    out.fill_(-7 if out.dtype == torch.int64 else float("nan"))
                for buf in buffers:
                    buf.fill_(-1)  # every bit set: a count past any split, the largest key
                graph.replay()
                torch.cuda.synchronize()
                for got, want in zip(outs, expected):
                    assert torch.equal(got, want)
    finally:
        for buf in buffers:  # as the kernels leave them, for the tests after this one
            buf.zero_()
        torch.cuda.synchronize()


_BACKEND_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    from llmspeed_numba.ops.warp_tile import warp_tile_matmul
    from llmspeed_numba.testing import random_array, to_device, to_host
    rng = np.random.default_rng(7)
    outs = []
    for dtype in ("float16", "bfloat16"):
        a = random_array((16, 1024), dtype, rng)
        b = random_array((1024, 8), dtype, rng)
        outs.append(to_host(warp_tile_matmul(to_device(a, "torch"), to_device(b, "torch"))))
    sys.stdout.buffer.write(np.concatenate([o.ravel() for o in outs]).tobytes())
""")


def _run_backend(backend):
    env = dict(os.environ, LLMSPEED_NUMBA_PTX_BACKEND=backend, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", _BACKEND_SCRIPT], capture_output=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return np.frombuffer(proc.stdout, np.float32)


def test_linked_backend_is_bit_identical_to_intrinsics():
    intrinsic = _run_backend("intrinsic")
    linked = _run_backend("linked")
    assert intrinsic.size == 2 * 16 * 8
    np.testing.assert_array_equal(intrinsic.view(np.uint32), linked.view(np.uint32))


def test_dynamic_shared_memory_beyond_48kb(rng):
    from llmspeed_numba._arrays import as_tensor, kernel_buffer
    from llmspeed_numba._launch import Kernel, array1d, jit

    nbytes = 200 * 1024
    words = nbytes // 4

    def reverse_through_shared(src, dst, n):
        smem = cuda.shared.array(0, np.float32)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            smem[i] = src[i]
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            dst[i] = smem[n - 1 - i]

    kernel = Kernel(jit(reverse_through_shared),
                    (array1d(np.float32), array1d(np.float32), types.int32), "reverse")
    src = cuda.to_device(random_array((words,), "float32", rng))
    dst = cuda.device_array(words, np.float32)
    kernel(1, 256, (kernel_buffer(as_tensor(src, "src")), kernel_buffer(as_tensor(dst, "dst")),
                    words), 0, nbytes)
    cuda.synchronize()
    np.testing.assert_array_equal(dst.copy_to_host(), src.copy_to_host()[::-1])


def test_programmatic_launch_waits_for_the_kernel_before(rng):
    """A slow writer releases its dependents at once, then sleeps before writing; the reader,
    launched with the programmatic attribute, starts early but reads only after
    ``griddep_wait``: every read sees its own round's value, eagerly and replayed from a graph.
    (A launch attribute laid out wrongly fails the launch or is ignored; a wait that did not
    wait reads the previous round's value.)"""
    torch = pytest.importorskip("torch")
    from llmspeed_numba import ptx
    from llmspeed_numba._arrays import as_tensor, kernel_buffer
    from llmspeed_numba._launch import Kernel, array1d, jit

    if cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("griddepcontrol needs sm_90")

    def slow_writer(values, i, box):
        ptx.griddep_launch_dependents()
        for _ in range(100):
            cuda.nanosleep(1000)
        box[0] = values[i]

    def reader(box, i, seen):
        ptx.griddep_wait()
        seen[i] = box[0]

    i32 = array1d(np.int32)
    write = Kernel(jit(slow_writer), (i32, types.int32, i32), "slow_writer")
    read = Kernel(jit(reader), (i32, types.int32, i32), "reader", programmatic=True)
    rounds = 16
    values = torch.arange(1, rounds + 1, dtype=torch.int32, device="cuda")
    box = torch.zeros(1, dtype=torch.int32, device="cuda")
    seen = torch.zeros(rounds, dtype=torch.int32, device="cuda")
    bufs = [kernel_buffer(as_tensor(t, name)) for t, name in ((values, "values"), (box, "box"),
                                                              (seen, "seen"))]

    def chain():
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(rounds):
            write(1, 32, (bufs[0], i, bufs[1]), stream)
            read(1, 32, (bufs[1], i, bufs[2]), stream)

    chain()
    torch.cuda.synchronize()
    assert seen.tolist() == values.tolist()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    seen.zero_()
    box.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert seen.tolist() == values.tolist()


def test_kernel_cache_is_reused_by_a_new_process(tmp_path):
    # both caches empty, so the first process compiles (a kernel already in the library's
    # machine-code store is never compiled, and numba's cache then gets no files)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               LLMSPEED_NUMBA_CACHE=str(tmp_path / "llmspeed"), PYTHONPATH=REPO)
    script = ("import numpy as np; from llmspeed_numba.ops.warp_tile import warp_tile_matmul;"
              "from numba import cuda;"
              "a = cuda.to_device(np.ones((16, 64), np.float16));"
              "b = cuda.to_device(np.ones((64, 8), np.float16));"
              "assert (warp_tile_matmul(a, b).copy_to_host() == 64).all()")
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    cached = [f for _, _, files in os.walk(tmp_path / "numba") for f in files]
    assert any(f.endswith(".nbi") for f in cached) and any(f.endswith(".nbc") for f in cached)
    assert any(f.endswith(".cubin") for f in os.listdir(tmp_path / "llmspeed" / "kernels"))
