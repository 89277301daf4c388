"""Memory access: 16-byte vector loads and stores, and the 32-bit shared-window address of an
element (alignment arithmetic; the ``linked`` backend's shared operands)."""

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from .common import _I32, _V4I32, _check_memory_operand, _element_pointer, _shared_address

__all__ = ["load_u32x4", "store_u32x4", "shared_address"]


# --------------------------------------------------------------------------------------------
# 16-byte vector access (global or shared: the pointer is generic, NVVM picks the space)
# --------------------------------------------------------------------------------------------

def _vector_pointer(context, builder, signature, args):
    ptr = _element_pointer(context, builder, signature.args[0], args[0],
                           signature.args[1], args[1])
    return builder.bitcast(ptr, _V4I32.as_pointer())


@intrinsic
def load_u32x4(typingctx, array, offset):
    """Load 16 bytes at element ``offset`` (16-byte aligned) as four uint32."""
    _check_memory_operand(array, offset, "load_u32x4")

    def codegen(context, builder, signature, args):
        vec = builder.load(_vector_pointer(context, builder, signature, args), align=16)
        items = [builder.extract_element(vec, ir.Constant(_I32, i)) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, items)

    return types.UniTuple(types.uint32, 4)(array, offset), codegen


@intrinsic
def store_u32x4(typingctx, array, offset, v0, v1, v2, v3):
    """Store four uint32 as 16 bytes at element ``offset`` (16-byte aligned)."""
    _check_memory_operand(array, offset, "store_u32x4")

    def codegen(context, builder, signature, args):
        vec = ir.Constant(_V4I32, ir.Undefined)
        for i in range(4):
            value = context.cast(builder, args[2 + i], signature.args[2 + i], types.uint32)
            vec = builder.insert_element(vec, value, ir.Constant(_I32, i))
        builder.store(vec, _vector_pointer(context, builder, signature, args), align=16)
        return context.get_dummy_value()

    return types.void(array, offset, v0, v1, v2, v3), codegen


# --------------------------------------------------------------------------------------------
# Shared-window addresses
# --------------------------------------------------------------------------------------------

@intrinsic
def shared_address(typingctx, smem, offset):
    """32-bit shared-window byte address of ``smem[offset]`` (for alignment arithmetic)."""
    _check_memory_operand(smem, offset, "shared_address")

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0],
                               signature.args[1], args[1])
        return _shared_address(builder, ptr)

    return types.uint32(smem, offset), codegen
