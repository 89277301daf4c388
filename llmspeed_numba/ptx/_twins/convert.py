"""Twins of ``_intrinsics/convert.py``: f32 <-> f16 / bf16 bits, packing, e4m3, bit casts."""

import numpy as np

from ..._fp8_codec import encode_e4m3
from .common import (_bf16_bits_to_f32, _bits16, _f16_bits_to_f32, _f32_to_bf16_bits,
                     _f32_to_f16_bits, _unpack)

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


# ---- bit casts -----------------------------------------------------------------------------

def f32_bits(x):
    return np.float32(x).view(np.uint32)


def f32_from_bits(bits):
    return np.uint32(bits).view(np.float32)


# ---- FP8 E4M3 ------------------------------------------------------------------------------

def pack_e4m3x2(lo, hi):
    codes = encode_e4m3(np.array([lo, hi], np.float32))
    return np.uint16(int(codes[0]) | (int(codes[1]) << 8))


# ---- packed half subtraction ---------------------------------------------------------------

def _sub_x2(a, b, to_f32, to_bits):
    a_lo, a_hi = _unpack(a, to_f32)
    b_lo, b_hi = _unpack(b, to_f32)
    # the exact difference (float64) through float32, then rounded: one rounding, as sub.rn
    # does, whenever the difference fits float32's 24 bits (the code conversions' always do)
    return np.uint32(to_bits(np.float32(a_lo - b_lo)) | (to_bits(np.float32(a_hi - b_hi)) << 16))


def sub_f16x2(a, b):
    return _sub_x2(a, b, _f16_bits_to_f32, _f32_to_f16_bits)


def sub_bf16x2(a, b):
    return _sub_x2(a, b, _bf16_bits_to_f32, _f32_to_bf16_bits)


# ---- byte permute --------------------------------------------------------------------------

def prmt(a, b, selector):
    source = int(a) & 0xFFFFFFFF | (int(b) & 0xFFFFFFFF) << 32
    sel = int(selector)
    out = 0
    for i in range(4):
        nibble = sel >> (4 * i) & 0xF
        byte = source >> (8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return np.uint32(out)
