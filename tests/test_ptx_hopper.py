"""The Hopper asynchronous-copy and synchronisation ops of the PTX layer against NumPy: mbarriers
(init, arrive with a token, arrive / expect transaction bytes, try_wait, the parity wait),
1-D bulk copies global -> shared, named barriers and elect.sync; then their operand checks, both
the simulator twins' (at run time) and the intrinsics' (at compile time, in a child process
without the simulator: no GPU needed).

Under the simulator the twins run (barrier state in the barrier's own shared-memory word, bulk
copies as plain copies completing on it); on a GPU the same kernels run the instructions, which
ties the twins' phase and transaction-count model to the hardware's. ``tests/test_bulk_stage.py``
runs the producer / consumer ring built from these ops.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llmspeed_numba import ptx
from llmspeed_numba._env import SIMULATOR, cuda

POISON = 0xDEADBEEF


# ---- mbarrier phases: arrive with a token / try_wait, and try_wait.parity ------------------

PHASES = 5


@cuda.jit
def _phases_kernel(src, out):
    """64 threads, one barrier of count 64, ``PHASES`` phases: each thread publishes a value in
    the buffer of the phase's parity, arrives, waits for the phase, then reads its neighbour's.
    Even phases wait on the arrive's token, odd ones on the parity; a buffer is rewritten two
    phases later, after every thread has passed the phase in between, so no other barrier is
    needed."""
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(128, np.uint32)
    bar = cuda.shared.array(1, np.uint64)
    if tid == 0:
        ptx.mbarrier_init(bar, 0, 64)
        ptx.fence_mbarrier_init()
    cuda.syncthreads()
    for phase in range(PHASES):
        half = (phase & 1) * 64
        buf[half + tid] = src[phase * 64 + tid]
        token = ptx.mbarrier_arrive(bar, 0)
        if phase & 1:
            while not ptx.mbarrier_try_wait_parity(bar, 0, phase & 1):
                pass
        else:
            while not ptx.mbarrier_try_wait(bar, 0, token):
                pass
        out[phase * 64 + tid] = buf[half + (tid + 1) % 64]


def test_mbarrier_phases(rng):
    src = rng.integers(0, 2**32, PHASES * 64, dtype=np.uint32)
    out = np.full_like(src, POISON)
    _phases_kernel[1, 64](src, out)
    expected = np.roll(src.reshape(PHASES, 64), -1, axis=1).ravel()
    np.testing.assert_array_equal(out, expected)


# ---- bulk copies: several on one phase, announced by arrive.expect_tx and expect_tx --------

#: (element offset in shared, element offset in global, elements) of each copy: uint32, so every
#: offset is a multiple of 4 elements (16 bytes); gaps in shared must stay poisoned.
COPIES = ((4, 0, 12), (20, 36, 4), (32, 12, 24))
SMEM_WORDS = 64


@cuda.jit
def _bulk_kernel(src, out):
    tid = cuda.threadIdx.x
    smem = cuda.shared.array(SMEM_WORDS, np.uint32, alignment=16)
    bar = cuda.shared.array(2, np.int64)  # an int64 word serves as well as a uint64
    for i in range(tid, SMEM_WORDS, 32):
        smem[i] = POISON
    if tid == 0:
        ptx.mbarrier_init(bar, 1, 1)
        ptx.fence_mbarrier_init()
    ptx.fence_proxy_async()  # each thread's poison (generic writes) before the async copies
    cuda.syncthreads()
    if tid == 0:
        ptx.mbarrier_expect_tx(bar, 1, 4 * COPIES[0][2])     # announced without arriving ...
        ptx.mbarrier_arrive_expect_tx(bar, 1, 4 * (COPIES[1][2] + COPIES[2][2]))  # ... the rest
        for c in range(len(COPIES)):
            ptx.cp_async_bulk_g2s(smem, COPIES[c][0], src, COPIES[c][1], 4 * COPIES[c][2], bar, 1)
    ptx.mbarrier_wait_parity(bar, 1, 0)
    for i in range(tid, SMEM_WORDS, 32):
        out[i] = smem[i]


def test_bulk_copies_complete_on_one_phase(rng):
    src = rng.integers(0, 2**32, 64, dtype=np.uint32)
    out = np.zeros(SMEM_WORDS, np.uint32)
    _bulk_kernel[1, 32](src, out)
    expected = np.full(SMEM_WORDS, POISON, np.uint32)
    for dst, first, count in COPIES:
        expected[dst:dst + count] = src[first:first + count]
    np.testing.assert_array_equal(out, expected)


# ---- cp.async announced on an mbarrier by the copies' own arrival (.noinc) -----------------

NOINC_ROUNDS = 3


@cuda.jit
def _noinc_kernel(src, out):
    """Warp 0 copies (cp.async, 16 bytes a lane) a 128-word tile a round into one of two
    buffers and announces it with ``cp_async_mbarrier_arrive_noinc`` (barrier count 32: one
    arrival a lane, made when its copies land; the lane does not wait). Warp 1 waits for the
    round's phase, fences the async proxy as a wgmma consumer would, reads the tile reversed
    and releases the buffer on a second barrier, which warp 0 waits for before reusing it."""
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(256, np.uint32, alignment=16)
    bars = cuda.shared.array(4, np.uint64)   # full[0..1], empty[0..1]
    if tid == 0:
        for s in range(2):
            ptx.mbarrier_init(bars, s, 32)
            ptx.mbarrier_init(bars, 2 + s, 32)
        ptx.fence_mbarrier_init()
    cuda.syncthreads()
    for r in range(NOINC_ROUNDS):
        s = r % 2
        if tid < 32:
            ptx.mbarrier_wait_parity(bars, 2 + s, ((r // 2) & 1) ^ 1)
            ptx.cp_async_16(buf, s * 128 + 4 * tid, src, r * 128 + 4 * tid, 16)
            ptx.cp_async_mbarrier_arrive_noinc(bars, s)
        else:
            c = tid - 32
            ptx.mbarrier_wait_parity(bars, s, (r // 2) & 1)
            ptx.fence_proxy_async()
            for j in range(4):
                out[r * 128 + 4 * c + j] = buf[s * 128 + 127 - (4 * c + j)]
            ptx.mbarrier_arrive(bars, 2 + s)
    if tid < 32:
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)


def test_cp_async_announced_by_noinc_arrival(rng):
    src = rng.integers(0, 2**32, NOINC_ROUNDS * 128, dtype=np.uint32)
    out = np.full_like(src, POISON)
    _noinc_kernel[1, 64](src, out)
    np.testing.assert_array_equal(out, src.reshape(NOINC_ROUNDS, 128)[:, ::-1].ravel())


# ---- named barriers and elect.sync --------------------------------------------------------

@cuda.jit
def _named_barrier_kernel(src, out, leaders):
    """Warps 0-1 publish 64 values and ``bar.arrive`` on barrier 1 (128 threads); warps 2-3
    ``bar.sync`` on it and read them. Barrier 2 (warps 2-3 only) then orders a second exchange
    among the consumers while warps 0-1 have gone on. Each warp's elected lane counts itself."""
    tid = cuda.threadIdx.x
    warp = tid // 32
    buf = cuda.shared.array(128, np.uint32)
    if warp < 2:
        buf[tid] = src[tid]
        ptx.named_barrier_arrive(1, 128)
    else:
        ptx.named_barrier_sync(1, 128)
        c = tid - 64
        out[c] = buf[63 - c]
        buf[64 + c] = out[c] + np.uint32(1)
        ptx.named_barrier_sync(2, 64)
        out[64 + c] = buf[64 + (c + 1) % 64]
    if ptx.elect_sync():
        cuda.atomic.add(leaders, warp, 1)


def test_named_barriers_and_elect(rng):
    src = rng.integers(0, 2**32 - 1, 64, dtype=np.uint32)
    out = np.full(128, POISON, np.uint32)
    leaders = np.zeros(4, np.int32)
    _named_barrier_kernel[1, 128](src, out, leaders)
    first = src[::-1]
    np.testing.assert_array_equal(out[:64], first)
    np.testing.assert_array_equal(out[64:], np.roll(first + np.uint32(1), -1))
    np.testing.assert_array_equal(leaders, [1, 1, 1, 1])   # exactly one lane of each warp


# ---- the twins' run-time checks (on a GPU these are hangs or faults, not errors) ----------

def _misuse_kernel(case):
    @cuda.jit
    def kernel(src):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(64, np.uint32, alignment=16)
        bar = cuda.shared.array(1, np.uint64)
        if tid == 0:
            ptx.mbarrier_init(bar, 0, 1)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        if case == 0 and tid == 0:      # 16 bytes announced, never delivered
            ptx.mbarrier_arrive_expect_tx(bar, 0, 32)
            ptx.cp_async_bulk_g2s(smem, 0, src, 0, 16, bar, 0)
        elif case == 1 and tid == 0:    # an arrival on a phase that has none pending
            ptx.mbarrier_arrive_expect_tx(bar, 0, 32)
            ptx.mbarrier_arrive(bar, 0)
        elif case == 2 and tid == 0:    # shared destination 4 bytes off 16-byte alignment
            ptx.mbarrier_arrive_expect_tx(bar, 0, 16)
            ptx.cp_async_bulk_g2s(smem, 1, src, 0, 16, bar, 0)
        elif case == 3 and tid == 0:    # not a multiple of 16 bytes
            ptx.mbarrier_arrive_expect_tx(bar, 0, 24)
            ptx.cp_async_bulk_g2s(smem, 0, src, 0, 24, bar, 0)
        elif case == 4 and tid == 0:    # global source past the end of the array
            ptx.mbarrier_arrive_expect_tx(bar, 0, 64)
            ptx.cp_async_bulk_g2s(smem, 0, src, 56, 64, bar, 0)
        ptx.mbarrier_wait_parity(bar, 0, 0)

    return kernel


MISUSE = [
    (0, 1, RuntimeError, "16 transaction bytes pending"),
    (1, 1, RuntimeError, "more arrivals than the mbarrier's count"),
    (2, 1, ValueError, "smem address must be 16-byte aligned"),
    (3, 1, ValueError, "positive multiple of 16"),
    (4, 1, IndexError, "gmem bytes"),
]


@pytest.mark.skipif(not SIMULATOR, reason="the simulator twins' checks")
@pytest.mark.parametrize("case,threads,error,message", MISUSE,
                         ids=["missing-bytes", "extra-arrival", "misaligned", "size", "bounds"])
def test_twin_checks(case, threads, error, message, monkeypatch):
    from llmspeed_numba.ptx._twins import common

    monkeypatch.setattr(common, "_RENDEZVOUS_TIMEOUT_S", 1.0)  # the hang, made an error sooner
    src = np.zeros(64, np.uint32)
    with pytest.raises(error, match=message):
        _misuse_kernel(case)[1, threads](src)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator twins' checks")
def test_twin_scalar_checks():
    from llmspeed_numba.ptx import _twins

    bar = np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="count must be in"):
        _twins.mbarrier_init(bar, 0, 0)
    with pytest.raises(TypeError, match="8-byte integer array"):
        _twins.mbarrier_init(np.zeros(2, np.uint32), 0, 1)
    with pytest.raises(ValueError, match="parity must be 0 or 1"):
        _twins.mbarrier_try_wait_parity(bar, 0, 2)
    for op in (_twins.setmaxnreg_inc, _twins.setmaxnreg_dec):
        op(240)
        for bad in (20, 100, 264):
            with pytest.raises(TypeError, match="multiple of 8 in"):
                op(bad)
    # a fresh barrier: the phase of parity 1 (before phase 0) counts as completed
    _twins.mbarrier_init(bar, 1, 2)
    assert _twins.mbarrier_try_wait_parity(bar, 1, 1)
    assert not _twins.mbarrier_try_wait_parity(bar, 1, 0)
    token = _twins.mbarrier_arrive(bar, 1)
    assert not _twins.mbarrier_try_wait(bar, 1, token)
    _twins.mbarrier_arrive(bar, 1)
    assert _twins.mbarrier_try_wait(bar, 1, token)
    assert _twins.mbarrier_try_wait_parity(bar, 1, 0) and not _twins.mbarrier_try_wait_parity(
        bar, 1, 1)


# ---- the intrinsics' compile-time checks (NVVM never runs: typing fails first) -------------

_TYPING_CHILD = r'''
import json, sys
import numpy as np
from numba import types
from numba.core.errors import NumbaError
from llmspeed_numba._env import cuda
from llmspeed_numba import ptx

def k_u32_barrier(a, n):
    bar = cuda.shared.array(1, np.uint32)
    ptx.mbarrier_init(bar, 0, 1)

def k_init_count(a, n):
    bar = cuda.shared.array(1, np.uint64)
    ptx.mbarrier_init(bar, 0, 0)

def k_bulk_size(a, n):
    bar = cuda.shared.array(1, np.uint64)
    s = cuda.shared.array(16, np.uint32)
    ptx.cp_async_bulk_g2s(s, 0, a, 0, 24, bar, 0)

def k_bulk_float_size(a, n):
    bar = cuda.shared.array(1, np.uint64)
    s = cuda.shared.array(16, np.uint32)
    ptx.cp_async_bulk_g2s(s, 0, a, 0, 16.0, bar, 0)

def k_parity(a, n):
    bar = cuda.shared.array(1, np.uint64)
    ptx.mbarrier_wait_parity(bar, 0, 2)

def k_expect_tx(a, n):
    bar = cuda.shared.array(1, np.uint64)
    ptx.mbarrier_arrive_expect_tx(bar, 0, 1 << 20)

def k_setmaxnreg_value(a, n):
    ptx.setmaxnreg_inc(100)

def k_setmaxnreg_runtime(a, n):
    ptx.setmaxnreg_dec(n)

def k_named_id(a, n):
    ptx.named_barrier_sync(16, 64)

def k_named_count(a, n):
    ptx.named_barrier_arrive(1, 48)

sig = (types.Array(types.uint32, 1, "C"), types.int32)
found = {}
for name in sys.argv[1:]:
    try:
        cuda.compile_ptx(globals()[name], sig, cc=(9, 0, "a"))
        found[name] = None
    except NumbaError as exc:
        found[name] = str(exc)
print(json.dumps(found))
'''

TYPING_CASES = {
    "k_u32_barrier": "mbarrier_init: the mbarrier must be an element of an 8-byte integer array",
    "k_init_count": "mbarrier_init: count must be in [1, 1048575], got 0",
    "k_bulk_size": "cp_async_bulk_g2s: nbytes must be a positive multiple of 16",
    "k_bulk_float_size": "cp_async_bulk_g2s: nbytes must be an integer",
    "k_parity": "mbarrier_wait_parity: parity must be 0 or 1, got 2",
    "k_expect_tx": "mbarrier_arrive_expect_tx: nbytes must be in [0, 1048575]",
    "k_setmaxnreg_value": "setmaxnreg_inc: count must be a multiple of 8 in [24, 256], got 100",
    "k_setmaxnreg_runtime": "setmaxnreg_dec count must be a compile-time integer",
    "k_named_id": "named_barrier_sync: barrier_id must be in [0, 15], got 16",
    "k_named_count": "named_barrier_arrive: count must be a positive multiple of 32",
}


@pytest.fixture(scope="module")
def typing_errors():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", _TYPING_CHILD, *TYPING_CASES], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(TYPING_CASES))
def test_intrinsic_operand_checks(case, typing_errors):
    message = typing_errors[case]
    assert message is not None, f"{case} compiled; expected: {TYPING_CASES[case]}"
    assert TYPING_CASES[case] in message, message[:2000]
