"""Inline-PTX implementations of the PTX op layer (the GPU backend).

Every op is a numba ``@intrinsic`` whose codegen emits one ``llvmlite.ir.InlineAsm`` (or a few
plain LLVM instructions), so it is inlined into the calling kernel without LTO and the kernel stays
cacheable on disk. ``_twins.py`` holds the pure-Python versions with the same signatures, used by
the CUDA simulator; ``__init__.py`` picks one set at import.

Conventions shared by both backends:
- fp16 / bf16 data is stored and passed as raw ``uint16`` bits; two halves packed in a ``uint32``
  register hold the lower-indexed element in the low 16 bits (the PTX fragment convention).
- Memory operands are ``(array, offset)``: any numba array and an element offset from its data
  pointer (a flat index for C-contiguous arrays). Shared-memory operands must be arrays in shared
  memory; the op converts the generic pointer to a 32-bit shared address.
"""

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

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


# --------------------------------------------------------------------------------------------
# cp.async (16 bytes, .cg: L2 only) with zero fill, commit / wait
# --------------------------------------------------------------------------------------------

@intrinsic
def cp_async_16(typingctx, smem, smem_offset, gmem, gmem_offset, src_bytes):
    """Copy 16 bytes global -> shared asynchronously; bytes past ``src_bytes`` are zero-filled
    and not read, so ``src_bytes == 0`` reads nothing (predicated-off edge rows)."""
    _check_memory_operand(smem, smem_offset, "cp_async_16 smem")
    _check_memory_operand(gmem, gmem_offset, "cp_async_16 gmem")
    if not isinstance(src_bytes, types.Integer):
        raise TypingError(f"cp_async_16: src_bytes must be an integer, got {src_bytes}")

    def codegen(context, builder, signature, args):
        s_ptr = _element_pointer(context, builder, signature.args[0], args[0],
                                 signature.args[1], args[1])
        g_ptr = _element_pointer(context, builder, signature.args[2], args[2],
                                 signature.args[3], args[3])
        size = context.cast(builder, args[4], signature.args[4], types.uint32)
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32],
             "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
             [_shared_address(builder, s_ptr), builder.ptrtoint(g_ptr, _I64), size],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(smem, smem_offset, gmem, gmem_offset, src_bytes), codegen


@intrinsic
def cp_async_commit(typingctx):
    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", [],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cp_async_wait(typingctx, n):
    """Wait until at most ``n`` committed cp.async groups are pending; ``n`` must be a
    compile-time integer (a literal or a closure constant of the kernel factory)."""
    if not isinstance(n, types.IntegerLiteral):
        raise TypingError(
            f"cp_async_wait: n must be a compile-time integer literal, got {n}; compute it in "
            "the kernel factory and capture it as a closure constant")
    pending = int(n.literal_value)

    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {pending};", "~{memory}", [],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(n), codegen


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
# Math and warp collectives
# --------------------------------------------------------------------------------------------

@intrinsic
def ex2_approx(typingctx, x):
    """2**x with the SFU's approximate exp2 (2 ulp; -inf -> +0, as softmax needs)."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        return _asm(builder, _F32, [_F32], "ex2.approx.ftz.f32 $0, $1;", "=f,f", [value])

    return types.float32(x), codegen


def _make_shfl_xor(value_type, llvm_type, constraint):
    text = "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;"

    @intrinsic
    def shfl_xor(typingctx, value, lane_mask):
        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], value_type)
            m = context.cast(builder, args[1], signature.args[1], types.int32)
            return _asm(builder, llvm_type, [llvm_type, _I32], text,
                        f"={constraint},{constraint},r", [v, m], side_effect=True)

        return value_type(value, lane_mask), codegen

    return shfl_xor


shfl_xor_f32 = _make_shfl_xor(types.float32, _F32, "f")
shfl_xor_i32 = _make_shfl_xor(types.int32, _I32, "r")


@intrinsic
def syncwarp(typingctx):
    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [], "bar.warp.sync 0xffffffff;", "~{memory}", [],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(), codegen


__all__ = [
    "mma_f16", "mma_bf16",
    "ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4",
    "ldmatrix_x1_trans", "ldmatrix_x2_trans", "ldmatrix_x4_trans",
    "cp_async_16", "cp_async_commit", "cp_async_wait",
    "load_u32x4", "store_u32x4",
    "pack_f16x2", "pack_bf16x2", "unpack_f16x2", "unpack_bf16x2",
    "f16_to_f32", "bf16_to_f32", "f32_to_f16", "f32_to_bf16",
    "ex2_approx", "shfl_xor_f32", "shfl_xor_i32", "syncwarp",
]


# --------------------------------------------------------------------------------------------
# Bit casts and fast trigonometry (fused ops: fp32 vector access, rotary embedding)
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

__all__ += ["f32_bits", "f32_from_bits", "sin_approx", "cos_approx"]


@intrinsic
def rcp_approx(typingctx, x):
    """1 / x with the SFU (rcp.approx.ftz.f32: max 1 ulp; 1/inf = 0, 1/0 = inf), the fast
    reciprocal of activations in half precision."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        return _asm(builder, _F32, [_F32], "rcp.approx.ftz.f32 $0, $1;", "=f,f", [value])

    return types.float32(x), codegen


__all__ += ["rcp_approx"]


@intrinsic
def shfl_idx_i32(typingctx, value, src_lane):
    """``value`` of lane ``src_lane`` (0..31) to every lane (shfl.sync.idx.b32; all 32 lanes
    take part): a warp broadcast, e.g. of per-lane prefetched page ids."""
    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.int32)
        s = context.cast(builder, args[1], signature.args[1], types.int32)
        return _asm(builder, _I32, [_I32, _I32],
                    "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", [v, s],
                    side_effect=True)

    return types.int32(value, src_lane), codegen


__all__ += ["shfl_idx_i32"]


def _pin_identities():
    """Give every op a fixed identity for pickling. numba's disk cache keys a kernel on a
    pickle of its closure; an intrinsic pickles with a uuid drawn at first use, different in
    every process, so a kernel capturing an op (``mma = ptx.mma_bf16 if IS_BF16 else ...``)
    would never hit the cache. A name-derived id makes that pickle the same in every process."""
    for name in __all__:
        op = globals()[name]
        if getattr(op, "_Intrinsic__uuid", None) is None:
            op._set_uuid(f"llmspeed_numba.ptx.{name}")


_pin_identities()
