"""Pure-Python twins of the PTX op layer, for the CUDA simulator.

Same names, arguments and results as ``_intrinsics.py``. Warp-collective ops (mma, ldmatrix,
shuffles) rendezvous the lanes of a warp: each simulated thread is a Python thread, so every lane
posts its operands, all wait on a barrier, each rebuilds the whole fragment from the posted
operands and takes its own part. The fragment layouts are the PTX ISA's; the GPU tests that run
one kernel on both targets tie these layouts to the hardware.
"""

import threading
import weakref

import numpy as np

from ._intrinsics import L2_PREFETCH_SIZES, MBARRIER_MAX_COUNT, SETMAXNREG_RANGE

_RENDEZVOUS_TIMEOUT_S = 120.0  # a lane that never arrives (exception, divergence) breaks the wait


class _Warp:
    def __init__(self, lanes):
        self.slots = [None] * lanes
        self.combined = None
        self.barrier = threading.Barrier(lanes, timeout=_RENDEZVOUS_TIMEOUT_S)


_warps_lock = threading.Lock()
_warps_by_block = weakref.WeakKeyDictionary()  # simulator BlockManager -> {warp index: _Warp}


def _lane_context():
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("warp-collective PTX twins must be called inside a simulated kernel")
    return thread, manager


def _exchange(value, combine=None):
    """Post ``value`` for this lane; return (lane, [value of every lane of the warp]), or with
    ``combine``, (lane, ``combine(values)``) computed once for the whole warp by its first lane
    (an mma's product, which every lane would otherwise rebuild)."""
    thread, manager = _lane_context()
    warp, lane = divmod(thread.thread_id, 32)
    with _warps_lock:
        warps = _warps_by_block.setdefault(manager, {})
        state = warps.get(warp)
        if state is None:
            threads_in_block = int(np.prod(manager._block_dim))
            state = warps[warp] = _Warp(min(32, threads_in_block - 32 * warp))
    state.slots[lane] = value
    state.barrier.wait()
    if combine is None:
        values = list(state.slots)
    elif lane == 0:
        try:
            state.combined = combine(list(state.slots))
        except Exception as exc:  # every lane raises it, none waits for a result
            state.combined = exc
    state.barrier.wait()  # nobody overwrites a slot (or the result) before every lane has read
    if combine is None:
        return lane, values
    if isinstance(state.combined, Exception):
        raise state.combined
    return lane, state.combined


# ---- bit helpers ---------------------------------------------------------------------------

def _bits16(x):
    return int(np.asarray(x).view(np.uint16)) if np.asarray(x).dtype.itemsize == 2 else int(x)


def _f16_bits_to_f32(bits):
    return float(np.uint16(bits).view(np.float16))


def _bf16_bits_to_f32(bits):
    return float(np.uint32(int(bits) << 16).view(np.float32))


def _f32_to_f16_bits(x):
    with np.errstate(over="ignore"):  # out-of-range values round to inf, as cvt.rn does
        return int(np.float16(np.float32(x)).view(np.uint16))


def _f32_to_bf16_bits(x):
    # round to nearest even, NaN kept quiet
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):
        return ((u >> 16) | 0x40) & 0xFFFF
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def _unpack(reg, to_f32):
    reg = int(reg)
    return to_f32(reg & 0xFFFF), to_f32((reg >> 16) & 0xFFFF)


# ---- MMA -----------------------------------------------------------------------------------

def _make_mma(to_f32):
    def product(posted):
        a = np.zeros((16, 16), np.float64)
        b = np.zeros((16, 8), np.float64)
        c = np.zeros((16, 8), np.float64)
        for src, regs in enumerate(posted):
            group, pair = divmod(src, 4)
            col = 2 * pair
            for reg, (row, k0) in zip(regs[0:4], ((group, col), (group + 8, col),
                                                  (group, col + 8), (group + 8, col + 8))):
                a[row, k0], a[row, k0 + 1] = _unpack(reg, to_f32)
            for reg, k0 in zip(regs[4:6], (col, col + 8)):
                b[k0, group], b[k0 + 1, group] = _unpack(reg, to_f32)
            c[group, col], c[group, col + 1], c[group + 8, col], c[group + 8, col + 1] = regs[6:10]
        return (a @ b + c).astype(np.float32)

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane, d = _exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), product)
        group, pair = divmod(lane, 4)
        col = 2 * pair
        return (d[group, col], d[group, col + 1], d[group + 8, col], d[group + 8, col + 1])

    return mma


mma_f16 = _make_mma(_f16_bits_to_f32)
mma_bf16 = _make_mma(_bf16_bits_to_f32)


# ---- ldmatrix ------------------------------------------------------------------------------

def _make_ldmatrix(count, trans):
    def ldmatrix(smem, offset):
        lane, offsets = _exchange(int(offset))
        flat = smem.reshape(-1) if hasattr(smem, "reshape") else smem
        regs = []
        for m in range(count):
            rows = offsets[8 * m: 8 * m + 8]  # lanes 8m..8m+7 give matrix m's row addresses
            if trans:
                lo = flat[rows[2 * (lane % 4)] + lane // 4]
                hi = flat[rows[2 * (lane % 4) + 1] + lane // 4]
            else:
                row = rows[lane // 4]
                lo = flat[row + 2 * (lane % 4)]
                hi = flat[row + 2 * (lane % 4) + 1]
            regs.append(np.uint32(_bits16(lo) | (_bits16(hi) << 16)))
        return regs[0] if count == 1 else tuple(regs)

    return ldmatrix


ldmatrix_x1 = _make_ldmatrix(1, False)
ldmatrix_x2 = _make_ldmatrix(2, False)
ldmatrix_x4 = _make_ldmatrix(4, False)
ldmatrix_x1_trans = _make_ldmatrix(1, True)
ldmatrix_x2_trans = _make_ldmatrix(2, True)
ldmatrix_x4_trans = _make_ldmatrix(4, True)


# ---- cp.async (a plain copy here; commit / wait have nothing to wait for) ------------------

def cp_async_16(smem, smem_offset, gmem, gmem_offset, src_bytes):
    itemsize = smem.dtype.itemsize
    count = 16 // itemsize
    if gmem.dtype.itemsize != itemsize:  # the bytes, as the hardware copies them
        data = np.zeros(16, np.uint8)
        valid = int(src_bytes)
        if valid:
            src = [gmem[gmem_offset + i] for i in range(valid // gmem.dtype.itemsize)]
            data[:valid] = np.array(src, dtype=gmem.dtype).view(np.uint8)
        for i, v in enumerate(data.view(smem.dtype)):
            smem[smem_offset + i] = v
        return
    valid = int(src_bytes) // gmem.dtype.itemsize
    for i in range(count):
        smem[smem_offset + i] = gmem[gmem_offset + i] if i < valid else 0


def cp_async_16_l2(smem, smem_offset, gmem, gmem_offset, src_bytes, prefetch):
    if prefetch not in L2_PREFETCH_SIZES:  # as the GPU build rejects it
        raise TypeError(f"cp_async_16_l2: prefetch must be one of {L2_PREFETCH_SIZES}, got "
                        f"{prefetch}")
    cp_async_16(smem, smem_offset, gmem, gmem_offset, src_bytes)  # the hint moves no data


def cp_async_commit():
    pass


def cp_async_wait(n):
    pass


# ---- 16-byte vector access -----------------------------------------------------------------

def _as_bytes(array, offset):
    itemsize = array.dtype.itemsize
    return np.array([array[offset + i] for i in range(16 // itemsize)], dtype=array.dtype), itemsize


def load_u32x4(array, offset):
    data, _ = _as_bytes(array, offset)
    words = data.view(np.uint32)
    return tuple(np.uint32(w) for w in words)


def store_u32x4(array, offset, v0, v1, v2, v3):
    words = np.array([v0, v1, v2, v3], dtype=np.uint32).view(array.dtype)
    for i, w in enumerate(words):
        array[offset + i] = w


# ---- conversions ---------------------------------------------------------------------------

def pack_f16x2(lo, hi):
    return np.uint32(_f32_to_f16_bits(lo) | (_f32_to_f16_bits(hi) << 16))


def pack_bf16x2(lo, hi):
    return np.uint32(_f32_to_bf16_bits(lo) | (_f32_to_bf16_bits(hi) << 16))


def unpack_f16x2(packed):
    lo, hi = _unpack(packed, _f16_bits_to_f32)
    return np.float32(lo), np.float32(hi)


def unpack_bf16x2(packed):
    lo, hi = _unpack(packed, _bf16_bits_to_f32)
    return np.float32(lo), np.float32(hi)


def f16_to_f32(bits):
    return np.float32(_f16_bits_to_f32(_bits16(bits)))


def bf16_to_f32(bits):
    return np.float32(_bf16_bits_to_f32(_bits16(bits)))


def f32_to_f16(x):
    return np.uint16(_f32_to_f16_bits(x))


def f32_to_bf16(x):
    return np.uint16(_f32_to_bf16_bits(x))


# ---- math and warp collectives -------------------------------------------------------------

def ex2_approx(x):
    # Python floats: np.errstate costs ~50 us a call, which dominated simulated softmax/sampling
    x = float(np.float32(x))
    if x >= 128.0:
        return np.float32(np.inf)
    return np.float32(2.0 ** x)


def shfl_xor_f32(value, lane_mask):
    lane, values = _exchange(np.float32(value))
    return np.float32(values[lane ^ int(lane_mask)])


def shfl_xor_i32(value, lane_mask):
    lane, values = _exchange(np.int32(value))
    return np.int32(values[lane ^ int(lane_mask)])


def syncwarp():
    _exchange(None)


# ---- bit casts and fast trigonometry -------------------------------------------------------

def f32_bits(x):
    return np.float32(x).view(np.uint32)


def f32_from_bits(bits):
    return np.uint32(bits).view(np.float32)


def sin_approx(x):
    return np.float32(np.sin(np.float32(x)))


def cos_approx(x):
    return np.float32(np.cos(np.float32(x)))


def rcp_approx(x):
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1.0) / np.float32(x))


def shfl_idx_i32(value, src_lane):
    lane, values = _exchange(np.int32(value))
    return np.int32(values[int(src_lane) % 32])


# ---- Hopper wgmma (the warpgroup's operands come from shared memory, so each thread computes
# its own accumulator fragment from the tiles: no rendezvous is needed) ----------------------

def wgmma_fence():
    pass


def wgmma_commit():
    pass


def fence_proxy_async():
    pass


def shared_address(smem, offset):
    # the simulator's shared arrays start at address 0: 1024-byte aligned, as a real kernel
    # arranges its swizzled tiles to be
    return np.uint32(int(offset) * smem.dtype.itemsize)


class _SmemDesc:
    """What a wgmma descriptor encodes: the array, start byte, LBO, SBO and swizzle mode."""

    def __init__(self, smem, start, lbo, sbo, swizzle):
        self.smem, self.start, self.lbo, self.sbo, self.swizzle = smem, start, lbo, sbo, swizzle

    def byte_addresses(self, mn, k, mn_major):
        """Byte addresses of elements (mn[i], k[j]) of the operand this descriptor describes
        (rows of A or columns of B along ``mn``), as the hardware reads them."""
        mn = np.asarray(mn)[:, None]
        k = np.asarray(k)[None, :]
        if self.swizzle == 0:
            if mn_major:
                raise NotImplementedError("wgmma twin: MN-major operands need the 128B swizzle")
            # 8x8 core matrices of 16 contiguous bytes per row: LBO along K, SBO along MN
            addr = self.start + (mn // 8) * self.sbo + (k // 8) * self.lbo + (mn % 8) * 16 \
                + 2 * (k % 8)
        else:
            if mn_major:   # 64-element MN panels LBO apart; 8-row K groups SBO apart
                addr = self.start + (mn // 64) * self.lbo + (k // 8) * self.sbo \
                    + (k % 8) * 128 + 2 * (mn % 64)
            else:          # 128-byte rows along K; 8-row MN groups SBO apart
                addr = self.start + (mn // 8) * self.sbo + (mn % 8) * 128 + 2 * k
            addr = addr ^ (((addr >> 7) & 7) << 4)   # 16-byte chunk ^= row within 1024 bytes
        return addr


def smem_desc(smem, offset, lbo_bytes, sbo_bytes, swizzle):
    return _SmemDesc(smem, int(offset) * smem.dtype.itemsize, lbo_bytes, sbo_bytes, swizzle)


def _b16_values(desc, mn, k, mn_major, is_bf16):
    bits = np.asarray(desc.smem).reshape(-1).view(np.uint16)
    raw = bits[desc.byte_addresses(mn, k, mn_major) // 2]
    if is_bf16:
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.view(np.float16).astype(np.float64)


def wgmma_m64k16(acc, desc_a, desc_b, accumulate, n, is_bf16, trans_a, trans_b):
    thread, _ = _lane_context()
    warp, lane = divmod(thread.thread_id % 128, 32)
    rows = 16 * warp + lane // 4 + np.array([0, 8])
    cols = (8 * np.arange(n // 8)[:, None] + 2 * (lane % 4) + np.array([0, 1])).reshape(-1)
    ks = np.arange(16)
    a = _b16_values(desc_a, rows, ks, trans_a, is_bf16)          # (2, 16)
    b = _b16_values(desc_b, cols, ks, trans_b, is_bf16).T        # (16, n / 4)
    d = a @ b                                                    # (2, n / 4)
    i = np.arange(n // 2)
    frag = d[(i // 2) % 2, (i // 4) * 2 + i % 2]
    base = np.asarray(acc[: n // 2], np.float64) if accumulate else 0.0
    acc[: n // 2] = (base + frag).astype(np.float32)


def wgmma_wait(acc, n_regs, pending):
    pass


# ---- Hopper mbarriers, bulk copies, setmaxnreg, named barriers, elect ----------------------
# An mbarrier twin keeps its state in the barrier's own 8-byte word of shared memory, as the
# hardware does (the encoding is the twin's: the hardware's is opaque), so barriers carved from
# dynamic shared memory, aliases and per-block copies behave as on the GPU. One condition
# variable guards every word; a completed phase wakes all waiters, each re-checks its barrier.
# The bulk copy is a plain copy made when it is issued, then its bytes complete on the barrier.

_mbarrier_changed = threading.Condition()
_TRY_WAIT_S = 0.002        # a try_wait suspends the thread a little, as the hardware's may
_FIELD = (1 << 21) - 1     # word: pending 0-20, expected 21-41, tx + 2**20 42-62, parity 63
_TX_BIAS = 1 << 20


def _words(bar, offset, name):
    array = np.asarray(getattr(bar, "_ary", bar))
    if array.dtype.itemsize != 8 or array.dtype.kind not in "iu":
        raise TypeError(f"{name}: the mbarrier must be an element of an 8-byte integer array in "
                        f"shared memory (uint64 or int64), got dtype {array.dtype}")
    words = array.reshape(-1).view(np.uint64)
    index = int(offset)
    if not 0 <= index < words.size:
        raise IndexError(f"{name}: mbarrier offset {index} is outside the array of "
                         f"{words.size}")
    return words, index


def _decode(word):
    word = int(word)
    return (word & _FIELD, (word >> 21) & _FIELD, ((word >> 42) & _FIELD) - _TX_BIAS,
            word >> 63)


def _encode(pending, expected, tx, parity):
    return np.uint64(pending | (expected << 21) | ((tx + _TX_BIAS) << 42) | (parity << 63))


def _mbarrier_update(bar, offset, arrivals, tx_delta, name):
    """Apply arrivals and a transaction-count change; complete the phase when both reach zero.
    Returns the parity of the phase they were applied to."""
    words, i = _words(bar, offset, name)
    with _mbarrier_changed:
        pending, expected, tx, parity = _decode(words[i])
        if expected == 0:
            raise RuntimeError(f"{name}: the mbarrier at offset {i} is not initialised "
                               "(mbarrier_init, then fence_mbarrier_init and syncthreads)")
        pending -= arrivals
        tx += tx_delta
        if pending < 0:
            raise RuntimeError(f"{name}: more arrivals than the mbarrier's count ({expected}) "
                               f"in one phase (offset {i})")
        if not -_TX_BIAS <= tx < _TX_BIAS:
            raise RuntimeError(f"{name}: transaction count {tx} out of range (offset {i})")
        if pending == 0 and tx == 0:
            words[i] = _encode(expected, expected, 0, parity ^ 1)
            _mbarrier_changed.notify_all()
        else:
            words[i] = _encode(pending, expected, tx, parity)
        return parity


def _check_bytes(nbytes, name, what="nbytes"):
    n = int(nbytes)
    if not 0 <= n <= MBARRIER_MAX_COUNT:
        raise ValueError(f"{name}: {what} must be in [0, {MBARRIER_MAX_COUNT}], got {n}")
    return n


def mbarrier_init(bar, offset, count):
    n = int(count)
    if not 1 <= n <= MBARRIER_MAX_COUNT:
        raise ValueError(f"mbarrier_init: count must be in [1, {MBARRIER_MAX_COUNT}], got {n}")
    words, i = _words(bar, offset, "mbarrier_init")
    with _mbarrier_changed:
        words[i] = _encode(n, n, 0, 0)


def fence_mbarrier_init():
    pass


def mbarrier_arrive(bar, offset):
    return np.uint64(_mbarrier_update(bar, offset, 1, 0, "mbarrier_arrive"))


def mbarrier_arrive_expect_tx(bar, offset, nbytes):
    n = _check_bytes(nbytes, "mbarrier_arrive_expect_tx")
    return np.uint64(_mbarrier_update(bar, offset, 1, n, "mbarrier_arrive_expect_tx"))


def mbarrier_expect_tx(bar, offset, nbytes):
    _mbarrier_update(bar, offset, 0, _check_bytes(nbytes, "mbarrier_expect_tx"),
                     "mbarrier_expect_tx")


def _phase_done(words, i, parity):
    return _decode(words[i])[3] != parity


def _check_parity(parity, name):
    p = int(parity)
    if p not in (0, 1):
        raise ValueError(f"{name}: parity must be 0 or 1, got {p}")
    return p


def _try_wait(words, i, parity, name):
    if getattr(threading.current_thread(), "abort", False):  # a kernel's retry loop ends too
        raise RuntimeError(f"{name}: another thread of the block failed")
    with _mbarrier_changed:
        return _mbarrier_changed.wait_for(lambda: _phase_done(words, i, parity), _TRY_WAIT_S)


def mbarrier_try_wait_parity(bar, offset, parity):
    p = _check_parity(parity, "mbarrier_try_wait_parity")
    words, i = _words(bar, offset, "mbarrier_try_wait_parity")
    return _try_wait(words, i, p, "mbarrier_try_wait_parity")


def mbarrier_try_wait(bar, offset, token):
    words, i = _words(bar, offset, "mbarrier_try_wait")
    return _try_wait(words, i, int(token) & 1, "mbarrier_try_wait")


def _blocking_wait(done, name, describe):
    """Wait for ``done()`` under ``_mbarrier_changed``: gives up when another simulated thread
    failed (the simulator sets ``abort``) or after the rendezvous timeout, a hang made an error."""
    thread = threading.current_thread()
    waited = 0.0
    with _mbarrier_changed:
        while not _mbarrier_changed.wait_for(done, 0.05):
            waited += 0.05
            if getattr(thread, "abort", False):
                raise RuntimeError(f"{name}: another thread of the block failed")
            if waited >= _RENDEZVOUS_TIMEOUT_S:
                raise RuntimeError(f"{name}: not done after {_RENDEZVOUS_TIMEOUT_S:.0f} s: "
                                   f"{describe()}")


def mbarrier_wait_parity(bar, offset, parity):
    p = _check_parity(parity, "mbarrier_wait_parity")
    words, i = _words(bar, offset, "mbarrier_wait_parity")

    def describe():
        pending, expected, tx, current = _decode(words[i])
        return (f"the phase of parity {p} of the mbarrier at offset {i} never completed "
                f"(current parity {current}: {pending} of {expected} arrivals and {tx} "
                "transaction bytes pending; a missing arrive, expect_tx or copy)")

    _blocking_wait(lambda: _phase_done(words, i, p), "mbarrier_wait_parity", describe)


def _byte_view(array, offset, nbytes, name, what):
    host = np.asarray(getattr(array, "_ary", array))
    if not host.flags.c_contiguous:
        raise ValueError(f"{name}: {what} must be contiguous")
    start = int(offset) * host.dtype.itemsize
    address = host.ctypes.data + start
    if address % 16:
        raise ValueError(f"{name}: {what} address must be 16-byte aligned, element offset "
                         f"{int(offset)} is at address {address:#x}")
    flat = host.reshape(-1).view(np.uint8)
    if start < 0 or start + nbytes > flat.size:
        raise IndexError(f"{name}: {what} bytes [{start}, {start + nbytes}) are outside the "
                         f"array of {flat.size} bytes")
    return flat[start:start + nbytes]


def cp_async_bulk_g2s(smem, smem_offset, gmem, gmem_offset, nbytes, bar, bar_offset):
    name = "cp_async_bulk_g2s"
    n = int(nbytes)
    if n <= 0 or n % 16 or n > MBARRIER_MAX_COUNT:
        raise ValueError(f"{name}: nbytes must be a positive multiple of 16 of at most "
                         f"{MBARRIER_MAX_COUNT}, got {n}")
    dst = _byte_view(smem, smem_offset, n, name, "smem")
    dst[:] = _byte_view(gmem, gmem_offset, n, name, "gmem")
    _mbarrier_update(bar, bar_offset, 0, -n, name)


def _setmaxnreg(count, name):
    low, high = SETMAXNREG_RANGE
    if int(count) % 8 or not low <= int(count) <= high:  # as the GPU build rejects it
        raise TypeError(f"{name}: count must be a multiple of 8 in [{low}, {high}], got "
                        f"{count}")


def setmaxnreg_inc(count):
    _setmaxnreg(count, "setmaxnreg_inc")


def setmaxnreg_dec(count):
    _setmaxnreg(count, "setmaxnreg_dec")


class _NamedBarrier:
    def __init__(self):
        self.arrived = 0
        self.generation = 0
        self.count = None


_named_barriers = weakref.WeakKeyDictionary()  # simulator BlockManager -> {(block, id): state}


def _named_barrier(barrier_id, count, name):
    i, n = int(barrier_id), int(count)
    if not 0 <= i < 16:
        raise ValueError(f"{name}: barrier_id must be in [0, 15], got {i}")
    if n <= 0 or n % 32:
        raise ValueError(f"{name}: count must be a positive multiple of 32 (whole warps), "
                         f"got {n}")
    thread, manager = _lane_context()
    with _mbarrier_changed:
        states = _named_barriers.setdefault(manager, {})
        state = states.setdefault((tuple(thread.blockIdx), i), _NamedBarrier())
        if state.count not in (None, n):
            raise RuntimeError(f"{name}: barrier {i} used with counts {state.count} and {n} in "
                               "one phase")
        state.count = n
        generation = state.generation
        state.arrived += 1
        if state.arrived == n:
            state.arrived, state.count = 0, None
            state.generation += 1
            _mbarrier_changed.notify_all()
    return state, generation


def named_barrier_sync(barrier_id, count):
    state, generation = _named_barrier(barrier_id, count, "named_barrier_sync")
    _blocking_wait(lambda: state.generation != generation, "named_barrier_sync",
                   lambda: f"barrier {int(barrier_id)}: {state.arrived} of {int(count)} "
                   "threads arrived")


def named_barrier_arrive(barrier_id, count):
    _named_barrier(barrier_id, count, "named_barrier_arrive")


def elect_sync():
    lane, _ = _exchange(None)
    return lane == 0
