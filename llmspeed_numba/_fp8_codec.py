"""The FP8 E4M3 ("e4m3fn": no infinities, one NaN code per sign) number format in NumPy: the
exact conversion from float32 that ``cvt.rn.satfinite.e4m3x2.f32`` performs, and the decoding
of codes. Shared by the PTX twins, the host-side weight quantization and the tests.

Layout of a code: sign (bit 7), exponent (bits 3-6, bias 7), mantissa (bits 0-2). Normal
values ``(1 + m / 8) 2^(e - 7)`` for e = 1..15 (e = 15 with m = 7 is NaN), subnormals
``m 2^-9``; the largest finite value is 448.

Encoding: round to nearest, ties to even, on the e4m3 grid of the value's binade (the
subnormal grid below 2^-6), then saturate to +-448 (``satfinite``: infinities too); NaN gives
0x7F. Every float32 is exact in float64, and so is every step below, so this is the correctly
rounded result.
"""

import numpy as np

#: Largest finite e4m3 value.
E4M3_MAX = 448.0
_MIN_NORMAL_EXP = -6     # 2^-6: the smallest normal
_SUBNORMAL_STEP = 2.0 ** -9
_NAN_CODE = 0x7F


def encode_e4m3(x):
    """float32 (any shape) -> uint8 e4m3 codes, round-to-nearest-even, saturating."""
    x = np.asarray(x, np.float32).astype(np.float64)
    sign = np.signbit(x)
    a = np.abs(x)
    nan = np.isnan(a)
    a = np.where(nan, 0.0, np.minimum(a, E4M3_MAX * 2))   # infinities saturate below
    _, e = np.frexp(a)                 # a = f 2^e, f in [0.5, 1): binade exponent e - 1
    exp = np.maximum(e - 1, _MIN_NORMAL_EXP)
    quantum = np.ldexp(1.0, exp - 3)   # 3 mantissa bits (the subnormal step below 2^-6)
    q = np.minimum(np.rint(a / quantum) * quantum, E4M3_MAX)
    _, qe = np.frexp(q)
    normal = q >= 2.0 ** _MIN_NORMAL_EXP
    q_exp = np.where(normal, qe - 1, _MIN_NORMAL_EXP)
    mant = np.where(normal, q / np.ldexp(1.0, q_exp - 3) - 8, q / _SUBNORMAL_STEP)
    bits = np.where(normal, ((q_exp + 7) << 3), 0) + mant.astype(np.int64)
    bits = np.where(nan, _NAN_CODE, bits) | np.where(sign, 0x80, 0)
    return bits.astype(np.uint8)


def _decode_table():
    codes = np.arange(256)
    e = (codes >> 3) & 15
    m = codes & 7
    mag = np.where(e == 0, m * _SUBNORMAL_STEP, (1 + m / 8.0) * np.ldexp(1.0, e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(codes >= 128, -mag, mag).astype(np.float32)


#: float32 value of each of the 256 codes (exact).
E4M3_VALUES = _decode_table()


def decode_e4m3(codes):
    """uint8 e4m3 codes (any shape) -> their float32 values (exact)."""
    return E4M3_VALUES[np.asarray(codes, np.uint8)]


def quantize_rows(x32):
    """Per-row e4m3 quantization of an (R, C) float32 matrix, as the kernels do it:
    ``s = max|x[r]| / 448`` (float32 division), codes ``e4m3(x[r] / s)`` (float32 division),
    an all-zero row s = 0 with zero codes. Returns (codes uint8 (R, C), s float32 (R,))."""
    x32 = np.asarray(x32, np.float32)
    s = (np.abs(x32).max(axis=1) / np.float32(E4M3_MAX)).astype(np.float32)
    safe = np.where(s == 0, np.float32(1), s)
    return encode_e4m3(x32 / safe[:, None]), s
