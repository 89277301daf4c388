"""Twins of ``_intrinsics/mma.py``: ``mma.sync`` m16n8k16 and ``ldmatrix`` (warp rendezvous)."""

import numpy as np

from .common import _bf16_bits_to_f32, _bits16, _exchange, _f16_bits_to_f32, _unpack

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
