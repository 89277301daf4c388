"""Conversions: f32 to and from f16 / bf16 bits (scalar, and two packed in a uint32), f32 pairs
to FP8 E4M3 codes, the bit casts between float32 and its uint32 bits, and the byte permute and packed subtraction
of an integer-code-to-half conversion (a code OR-ed into a half's mantissa, minus the
magic number and zero point: exact)."""

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from .common import _F32, _I16, _I32, _asm, _tuple

__all__ = [
    "pack_f16x2", "pack_bf16x2", "unpack_f16x2", "unpack_bf16x2",
    "f16_to_f32", "bf16_to_f32", "f32_to_f16", "f32_to_bf16",
    "f32_bits", "f32_from_bits", "pack_e4m3x2", "sub_f16x2", "sub_bf16x2", "prmt",
]


# --------------------------------------------------------------------------------------------
# Conversions between f32 and packed / scalar f16, bf16 bits
# --------------------------------------------------------------------------------------------

def _make_pack(kind):
    # cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the upper half: pass (hi, lo).
    text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

    @intrinsic
    def pack(typingctx, lo, hi):
        def codegen(context, builder, signature, args):
            lo_v = context.cast(builder, args[0], signature.args[0], types.float32)
            hi_v = context.cast(builder, args[1], signature.args[1], types.float32)
            return _asm(builder, _I32, [_F32, _F32], text, "=r,f,f", [hi_v, lo_v])

        return types.uint32(lo, hi), codegen

    return pack


pack_f16x2 = _make_pack("f16")
pack_bf16x2 = _make_pack("bf16")


@intrinsic
def unpack_f16x2(typingctx, packed):
    """uint32 holding two f16 -> (low, high) as float32."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.uint32)
        out = _asm(builder, ir.LiteralStructType([_F32, _F32]), [_I32],
                   "{.reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; "
                   "cvt.f32.f16 $1, hi;}", "=f,=f,r", [value])
        return _tuple(context, builder, signature, out, 2)

    return types.UniTuple(types.float32, 2)(packed), codegen


@intrinsic
def unpack_bf16x2(typingctx, packed):
    """uint32 holding two bf16 -> (low, high) as float32 (exact: bf16 is truncated f32)."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.uint32)
        lo = builder.bitcast(builder.shl(value, ir.Constant(_I32, 16)), _F32)
        hi = builder.bitcast(builder.and_(value, ir.Constant(_I32, 0xFFFF0000)), _F32)
        return context.make_tuple(builder, signature.return_type, [lo, hi])

    return types.UniTuple(types.float32, 2)(packed), codegen


@intrinsic
def f16_to_f32(typingctx, bits):
    """uint16 f16 bits -> float32."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.uint16)
        return _asm(builder, _F32, [_I16], "cvt.f32.f16 $0, $1;", "=f,h", [value])

    return types.float32(bits), codegen


@intrinsic
def bf16_to_f32(typingctx, bits):
    """uint16 bf16 bits -> float32 (exact)."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.uint16)
        wide = builder.shl(builder.zext(value, _I32), ir.Constant(_I32, 16))
        return builder.bitcast(wide, _F32)

    return types.float32(bits), codegen


def _make_round(kind):
    text = f"cvt.rn.{kind}.f32 $0, $1;"

    @intrinsic
    def round_to(typingctx, x):
        def codegen(context, builder, signature, args):
            value = context.cast(builder, args[0], signature.args[0], types.float32)
            return _asm(builder, _I16, [_F32], text, "=h,f", [value])

        return types.uint16(x), codegen

    return round_to


f32_to_f16 = _make_round("f16")
f32_to_bf16 = _make_round("bf16")


# --------------------------------------------------------------------------------------------
# Bit casts (fused ops: fp32 data through 16-byte vector access)
# --------------------------------------------------------------------------------------------

@intrinsic
def f32_bits(typingctx, x):
    """float32 -> its IEEE bits as uint32 (a register move, no conversion)."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        return builder.bitcast(value, _I32)

    return types.uint32(x), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """uint32 IEEE bits -> float32 (a register move): fp32 data read with ``load_u32x4``."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(value, _F32)

    return types.float32(bits), codegen


# --------------------------------------------------------------------------------------------
# FP8 E4M3 (sm_89+): two f32 rounded to nearest even, saturated to +-448 (``_fp8_codec``)
# --------------------------------------------------------------------------------------------

@intrinsic
def pack_e4m3x2(typingctx, lo, hi):
    """Two float32 -> two e4m3 codes packed in a uint16, ``lo``'s in the low byte
    (``cvt.rn.satfinite.e4m3x2.f32``, which puts its first source in the upper byte)."""
    def codegen(context, builder, signature, args):
        lo_v = context.cast(builder, args[0], signature.args[0], types.float32)
        hi_v = context.cast(builder, args[1], signature.args[1], types.float32)
        return _asm(builder, _I16, [_F32, _F32], "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;",
                    "=h,f,f", [hi_v, lo_v])

    return types.uint16(lo, hi), codegen


# --------------------------------------------------------------------------------------------
# Packed half subtraction: two f16 / bf16 lanes at once (sub.bf16x2 needs sm_90)
# --------------------------------------------------------------------------------------------

def _make_sub(kind):
    text = f"sub.rn.{kind}x2 $0, $1, $2;"

    @intrinsic
    def sub(typingctx, a, b):
        def codegen(context, builder, signature, args):
            a_v = context.cast(builder, args[0], signature.args[0], types.uint32)
            b_v = context.cast(builder, args[1], signature.args[1], types.uint32)
            return _asm(builder, _I32, [_I32, _I32], text, "=r,r,r", [a_v, b_v])

        return types.uint32(a, b), codegen

    return sub


sub_f16x2 = _make_sub("f16")
sub_bf16x2 = _make_sub("bf16")


# --------------------------------------------------------------------------------------------
# Byte permute: a code's byte beside a half's exponent byte in one instruction
# --------------------------------------------------------------------------------------------

@intrinsic
def prmt(typingctx, a, b, selector):
    """``prmt.b32`` (default mode): result byte i is byte ``selector >> 4i & 7`` of the 8 bytes
    (a's 0-3, b's 4-7), or, with bit ``4i + 3`` set, that byte's sign bit replicated."""
    def codegen(context, builder, signature, args):
        vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, signature.args)]
        return _asm(builder, _I32, [_I32] * 3, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", vals)

    return types.uint32(a, b, selector), codegen
