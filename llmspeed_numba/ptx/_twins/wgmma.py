"""Twins of ``_intrinsics/wgmma.py``: Hopper warpgroup MMA from shared-memory descriptors."""

import numpy as np

from ..._fp8_codec import E4M3_VALUES
from .common import _bf16_bits_to_f32, _exchange, _f16_bits_to_f32, _lane_context, _unpack

# ---- Hopper wgmma (the warpgroup's operands come from shared memory, so each thread computes
# its own accumulator fragment from the tiles: no rendezvous is needed) ----------------------

def wgmma_fence():
    pass


def wgmma_commit():
    pass


def fence_proxy_async():
    pass


class _SmemDesc:
    """What a wgmma descriptor encodes: the array, start byte, LBO, SBO and swizzle mode."""

    def __init__(self, smem, start, lbo, sbo, swizzle):
        self.smem, self.start, self.lbo, self.sbo, self.swizzle = smem, start, lbo, sbo, swizzle

    def byte_addresses(self, mn, k, mn_major, size=2):
        """Byte addresses of elements (mn[i], k[j]) of the operand this descriptor describes
        (rows of A or columns of B along ``mn``), as the hardware reads them; ``size``: bytes
        an element (2: f16 / bf16; 1: e4m3, K-major only)."""
        mn = np.asarray(mn)[:, None]
        k = np.asarray(k)[None, :]
        if mn_major and size != 2:
            raise NotImplementedError("wgmma twin: 8-bit operands are K-major only")
        per = 16 // size   # elements of a 16-byte core-matrix row
        if self.swizzle == 0:
            if mn_major:
                raise NotImplementedError("wgmma twin: MN-major operands need the 128B swizzle")
            # 8-row core matrices of 16 contiguous bytes per row: LBO along K, SBO along MN
            addr = self.start + (mn // 8) * self.sbo + (k // per) * self.lbo + (mn % 8) * 16 \
                + size * (k % per)
        else:
            if mn_major:   # 64-element MN panels LBO apart; 8-row K groups SBO apart
                addr = self.start + (mn // 64) * self.lbo + (k // 8) * self.sbo \
                    + (k % 8) * 128 + 2 * (mn % 64)
            else:          # 128-byte rows along K; 8-row MN groups SBO apart
                addr = self.start + (mn // 8) * self.sbo + (mn % 8) * 128 + size * k
            addr = addr ^ (((addr >> 7) & 7) << 4)   # 16-byte chunk ^= row within 1024 bytes
        return addr


def smem_desc(smem, offset, lbo_bytes, sbo_bytes, swizzle):
    return _SmemDesc(smem, int(offset) * smem.dtype.itemsize, lbo_bytes, sbo_bytes, swizzle)


def smem_desc_advance(desc, byte_offset):
    return _SmemDesc(desc.smem, desc.start + int(byte_offset), desc.lbo, desc.sbo, desc.swizzle)


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


def _e4m3_values(desc, mn, k):
    raw = np.asarray(desc.smem).reshape(-1).view(np.uint8)
    return E4M3_VALUES[raw[desc.byte_addresses(mn, k, False, 1)]].astype(np.float64)


def wgmma_m64k32_e4m3(acc, desc_a, desc_b, accumulate, n):
    thread, _ = _lane_context()
    warp, lane = divmod(thread.thread_id % 128, 32)
    rows = 16 * warp + lane // 4 + np.array([0, 8])
    cols = (8 * np.arange(n // 8)[:, None] + 2 * (lane % 4) + np.array([0, 1])).reshape(-1)
    ks = np.arange(32)
    d = _e4m3_values(desc_a, rows, ks) @ _e4m3_values(desc_b, cols, ks).T   # (2, n / 4)
    i = np.arange(n // 2)
    frag = d[(i // 2) % 2, (i // 4) * 2 + i % 2]
    base = np.asarray(acc[: n // 2], np.float64) if accumulate else 0.0
    acc[: n // 2] = (base + frag).astype(np.float32)


def _a_fragment(posted, to_f32):
    """The warp's 16 x 16 A slice from its lanes' (a0, a1, a2, a3): mma.sync's A layout."""
    a = np.zeros((16, 16), np.float64)
    for lane, regs in enumerate(posted):
        g, col = lane // 4, 2 * (lane % 4)
        for reg, (row, k0) in zip(regs, ((g, col), (g + 8, col), (g, col + 8),
                                         (g + 8, col + 8))):
            a[row, k0], a[row, k0 + 1] = _unpack(reg, to_f32)
    return a


def wgmma_m64k16_rs(acc, a0, a1, a2, a3, desc_b, accumulate, n, is_bf16, trans_b):
    # A lives in registers: the lanes of each warp pool their fragments (a warp rendezvous)
    to_f32 = _bf16_bits_to_f32 if is_bf16 else _f16_bits_to_f32
    lane, a = _exchange((int(a0), int(a1), int(a2), int(a3)),
                        lambda posted: _a_fragment(posted, to_f32))
    rows = a[lane // 4 + np.array([0, 8])]                       # (2, 16)
    cols = (8 * np.arange(n // 8)[:, None] + 2 * (lane % 4) + np.array([0, 1])).reshape(-1)
    b = _b16_values(desc_b, cols, np.arange(16), trans_b, is_bf16).T   # (16, n / 4)
    d = rows @ b
    i = np.arange(n // 2)
    frag = d[(i // 2) % 2, (i // 4) * 2 + i % 2]
    base = np.asarray(acc[: n // 2], np.float64) if accumulate else 0.0
    acc[: n // 2] = (base + frag).astype(np.float32)


def wgmma_wait(acc, n_regs, pending):
    pass
