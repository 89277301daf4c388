"""Warp-level Tensor Core ops: ``mma.sync`` m16n8k16 (f16 / bf16 inputs, f32 accumulate) and
``ldmatrix``, which loads their fragments from shared memory (layouts: ``ptx/__init__.py``)."""

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from .common import (_F32, _I32, _asm, _check_memory_operand, _element_pointer, _shared_address,
                     _tuple)

__all__ = [
    "mma_f16", "mma_bf16",
    "ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4",
    "ldmatrix_x1_trans", "ldmatrix_x2_trans", "ldmatrix_x4_trans",
]


# --------------------------------------------------------------------------------------------
# Tensor Core MMA: m16n8k16, f32 accumulate
# --------------------------------------------------------------------------------------------

def _make_mma(input_type):
    text = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{input_type}.{input_type}.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
    )

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(
            types.uint32, types.uint32, types.uint32, types.uint32,
            types.uint32, types.uint32,
            types.float32, types.float32, types.float32, types.float32,
        )

        def codegen(context, builder, signature, args):
            casted = [
                context.cast(builder, v, t, st)
                for v, t, st in zip(args, signature.args, sig.args)
            ]
            out = _asm(builder, ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4,
                       text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", casted)
            return _tuple(context, builder, signature, out, 4)

        return types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    return mma


mma_f16 = _make_mma("f16")
mma_bf16 = _make_mma("bf16")


# --------------------------------------------------------------------------------------------
# ldmatrix: .x1 / .x2 / .x4, optionally .trans (b16 elements, shared memory)
# --------------------------------------------------------------------------------------------

def _make_ldmatrix(count, trans):
    outs = ",".join(f"${i}" for i in range(count))
    text = (
        f"ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if trans else ''}.shared.b16 "
        f"{{{outs}}}, [${count}];"
    )
    constraints = ",".join(["=r"] * count + ["r"])
    name = f"ldmatrix_x{count}{'_trans' if trans else ''}"

    @intrinsic
    def ldmatrix(typingctx, smem, offset):
        _check_memory_operand(smem, offset, name)

        def codegen(context, builder, signature, args):
            ptr = _element_pointer(context, builder, signature.args[0], args[0],
                                   signature.args[1], args[1])
            address = _shared_address(builder, ptr)
            if count == 1:
                return _asm(builder, _I32, [_I32], text, constraints, [address],
                            side_effect=True)
            out = _asm(builder, ir.LiteralStructType([_I32] * count), [_I32], text, constraints,
                       [address], side_effect=True)
            return _tuple(context, builder, signature, out, count)

        ret = types.uint32 if count == 1 else types.UniTuple(types.uint32, count)
        return ret(smem, offset), codegen

    ldmatrix.__name__ = name
    return ldmatrix


ldmatrix_x1 = _make_ldmatrix(1, False)
ldmatrix_x2 = _make_ldmatrix(2, False)
ldmatrix_x4 = _make_ldmatrix(4, False)
ldmatrix_x1_trans = _make_ldmatrix(1, True)
ldmatrix_x2_trans = _make_ldmatrix(2, True)
ldmatrix_x4_trans = _make_ldmatrix(4, True)
