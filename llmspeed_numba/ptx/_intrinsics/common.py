"""What the intrinsic families share: the llvmlite types, the inline-asm call, the pointer and
32-bit shared-window address of a memory operand, operand checks, compile-time literals, and two
ways to make ops (``_make_plain`` for an operand-less asm statement, ``_literal_first_intrinsic``
with ``_unless`` for ops that range-check literal operands)."""

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import _intrinsic, intrinsic

#: ``intrinsic`` whose typing sees literal arguments first (numba's ``prefer_literal``), for ops
#: that range-check a literal operand but also take run-time values (see ``_unless``).
#: numba-cuda's public ``intrinsic`` is this module function with ``target="cuda"`` and takes no
#: other option.
_literal_first_intrinsic = _intrinsic(target="cuda", prefer_literal=True)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_V4I32 = ir.VectorType(_I32, 4)


def _asm(builder, ret_type, arg_types, text, constraints, args, side_effect=False):
    fnty = ir.FunctionType(ret_type, arg_types)
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)


def _tuple(context, builder, sig, struct_value, n):
    items = [builder.extract_value(struct_value, i) for i in range(n)]
    return context.make_tuple(builder, sig.return_type, items)


def _element_pointer(context, builder, array_type, array_value, offset_type, offset_value):
    """Generic pointer to element ``offset`` of the array's data."""
    array = context.make_array(array_type)(context, builder, array_value)
    offset = context.cast(builder, offset_value, offset_type, types.intp)
    return builder.gep(array.data, [offset])


def _shared_address(builder, pointer):
    """32-bit shared-window address of a generic pointer into shared memory."""
    shared = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 3))
    return builder.ptrtoint(shared, _I32)


def _check_memory_operand(array, offset, name):
    if not isinstance(array, types.Array):
        raise TypingError(f"{name}: expected an array operand, got {array}")
    if not isinstance(offset, types.Integer):
        raise TypingError(f"{name}: expected an integer element offset, got {offset}")


def _literal_int(value, name):
    if not isinstance(value, types.IntegerLiteral):
        raise TypingError(f"{name} must be a compile-time integer (a literal or a closure "
                          f"constant of the kernel factory), got {value}")
    return int(value.literal_value)


def _make_plain(text, name, doc):
    @intrinsic
    def op(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return types.void(), codegen

    op.__name__ = name
    op.__doc__ = doc
    return op


def _unless(problem, codegen):
    """``codegen``, or, when a literal operand is out of range (``problem``), one that fails the
    compile with that message. Ops with such checks type literal arguments first
    (``prefer_literal``); an error raised at typing would be lost, as numba then retries the call
    with the operand's non-literal type, which passes, and the bad value would compile."""
    if problem is None:
        return codegen

    def fail(context, builder, signature, args):
        raise TypingError(problem)

    return fail
