"""Fast math on the SFU (the special function unit): approximate exp2, sin / cos and reciprocal
(softmax, rotary embedding, activations); a division without IEEE rounding's slow path."""

from numba import types
from numba.cuda.extending import intrinsic

from .common import _F32, _asm

__all__ = ["ex2_approx", "sin_approx", "cos_approx", "rcp_approx", "div_full"]


@intrinsic
def ex2_approx(typingctx, x):
    """2**x with the SFU's approximate exp2 (2 ulp; -inf -> +0, as softmax needs)."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        return _asm(builder, _F32, [_F32], "ex2.approx.ftz.f32 $0, $1;", "=f,f", [value])

    return types.float32(x), codegen


def _make_trig(name):
    text = f"{name}.approx.ftz.f32 $0, $1;"

    @intrinsic
    def trig(typingctx, x):
        def codegen(context, builder, signature, args):
            value = context.cast(builder, args[0], signature.args[0], types.float32)
            return _asm(builder, _F32, [_F32], text, "=f,f", [value])

        return types.float32(x), codegen

    trig.__name__ = f"{name}_approx"
    return trig


#: sin / cos with the SFU (max absolute error 2^-20.5 on [-pi, pi]; reduce the argument first).
#: Unlike ``math.sin`` (libdevice sinf) they never take the Payne-Hanek slow path, which puts a
#: local-memory array in every kernel that calls them.
sin_approx = _make_trig("sin")
cos_approx = _make_trig("cos")


@intrinsic
def rcp_approx(typingctx, x):
    """1 / x with the SFU (rcp.approx.ftz.f32: max 1 ulp; 1/inf = 0, 1/0 = inf), the fast
    reciprocal of activations in half precision."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        return _asm(builder, _F32, [_F32], "rcp.approx.ftz.f32 $0, $1;", "=f,f", [value])

    return types.float32(x), codegen


@intrinsic
def div_full(typingctx, x, y):
    """x / y by ``div.full.f32`` (full range, max 2 ulp): inline instructions, where ``/``
    (``div.rn.f32``) calls a slow-path subroutine for edge operands, and a kernel with a call
    has every wgmma serialised by ptxas (C7509)."""
    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.float32)
        b = context.cast(builder, args[1], signature.args[1], types.float32)
        return _asm(builder, _F32, [_F32, _F32], "div.full.f32 $0, $1, $2;", "=f,f,f", [a, b])

    return types.float32(x, y), codegen
