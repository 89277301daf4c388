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

def _copy_operands(context, builder, signature, args):
    """Asm operands of a copy op called as ``(smem, smem_offset, gmem, gmem_offset, size, ...)``:
    the 32-bit shared address, the 64-bit global address and the size as uint32."""
    s_ptr = _element_pointer(context, builder, signature.args[0], args[0],
                             signature.args[1], args[1])
    g_ptr = _element_pointer(context, builder, signature.args[2], args[2],
                             signature.args[3], args[3])
    size = context.cast(builder, args[4], signature.args[4], types.uint32)
    return [_shared_address(builder, s_ptr), builder.ptrtoint(g_ptr, _I64), size]


def _cp_async_16_codegen(hint):
    """Codegen of a 16-byte cp.async (.cg) with src-size; ``hint`` an L2 prefetch-size suffix."""

    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32],
             f"cp.async.cg.shared.global{hint} [$0], [$1], 16, $2;", "r,l,r,~{memory}",
             _copy_operands(context, builder, signature, args), side_effect=True)
        return context.get_dummy_value()

    return codegen


def _check_cp_async_operands(name, smem, smem_offset, gmem, gmem_offset, src_bytes):
    _check_memory_operand(smem, smem_offset, f"{name} smem")
    _check_memory_operand(gmem, gmem_offset, f"{name} gmem")
    if not isinstance(src_bytes, types.Integer):
        raise TypingError(f"{name}: src_bytes must be an integer, got {src_bytes}")


@intrinsic
def cp_async_16(typingctx, smem, smem_offset, gmem, gmem_offset, src_bytes):
    """Copy 16 bytes global -> shared asynchronously; bytes past ``src_bytes`` are zero-filled
    and not read, so ``src_bytes == 0`` reads nothing (predicated-off edge rows)."""
    _check_cp_async_operands("cp_async_16", smem, smem_offset, gmem, gmem_offset, src_bytes)
    return (types.void(smem, smem_offset, gmem, gmem_offset, src_bytes),
            _cp_async_16_codegen(""))


#: ``cp_async_16_l2``'s prefetch sizes (bytes; 0: no hint, as ``cp_async_16``).
L2_PREFETCH_SIZES = (0, 64, 128, 256)


@intrinsic
def cp_async_16_l2(typingctx, smem, smem_offset, gmem, gmem_offset, src_bytes, prefetch):
    """``cp_async_16`` with an L2 prefetch-size hint (``.L2::64B`` / ``128B`` / ``256B``, a
    compile-time literal): the L2 may fetch that aligned span around the 16 bytes from DRAM in
    one go, for streams whose rows are that long but whose requests arrive spread in time."""
    _check_cp_async_operands("cp_async_16_l2", smem, smem_offset, gmem, gmem_offset, src_bytes)
    if not (isinstance(prefetch, types.IntegerLiteral)
            and prefetch.literal_value in L2_PREFETCH_SIZES):
        raise TypingError(f"cp_async_16_l2: prefetch must be a compile-time literal in "
                          f"{L2_PREFETCH_SIZES}, got {prefetch}")
    size_hint = int(prefetch.literal_value)
    return (types.void(smem, smem_offset, gmem, gmem_offset, src_bytes, prefetch),
            _cp_async_16_codegen(f".L2::{size_hint}B" if size_hint else ""))


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
    "cp_async_16", "cp_async_16_l2", "cp_async_commit", "cp_async_wait",
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



# --------------------------------------------------------------------------------------------
# Hopper warpgroup MMA (wgmma.mma_async, sm_90a): A and B from shared-memory descriptors,
# f32 accumulators in registers. One warpgroup (4 consecutive warps, 128 threads) issues it
# together; the accumulator fragment of m64nNk16 is, for warp w of the group and lane l,
# register i -> row 16w + l/4 + 8 * ((i/2) % 2), column 8 * (i/4) + 2 * (l%4) + i%2.
# --------------------------------------------------------------------------------------------

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


wgmma_fence = _make_plain(
    "wgmma.fence.sync.aligned;", "wgmma_fence",
    "Orders earlier register and shared-memory accesses before the next wgmma.mma_async.")
wgmma_commit = _make_plain(
    "wgmma.commit_group.sync.aligned;", "wgmma_commit",
    "Closes the group of wgmma.mma_async issued since the previous commit.")
fence_proxy_async = _make_plain(
    "fence.proxy.async.shared::cta;", "fence_proxy_async",
    "Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to "
    "the async proxy that wgmma reads its operands through; put it before the barrier.")


@intrinsic
def shared_address(typingctx, smem, offset):
    """32-bit shared-window byte address of ``smem[offset]`` (for alignment arithmetic)."""
    _check_memory_operand(smem, offset, "shared_address")

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0],
                               signature.args[1], args[1])
        return _shared_address(builder, ptr)

    return types.uint32(smem, offset), codegen


@intrinsic
def smem_desc(typingctx, smem, offset, lbo_bytes, sbo_bytes, swizzle):
    """64-bit wgmma matrix descriptor of the tile starting at ``smem[offset]``.

    ``lbo_bytes`` / ``sbo_bytes`` (leading / stride byte offsets) and ``swizzle`` (0 none, 1
    128-byte) are compile-time integers: they fold into the constant high word, only the address
    field (bits 0-13: address >> 4) is computed at run time. Bits 16-29 hold LBO >> 4, 32-45
    SBO >> 4, 62-63 the swizzle mode."""
    _check_memory_operand(smem, offset, "smem_desc")
    lbo = _literal_int(lbo_bytes, "smem_desc lbo_bytes")
    sbo = _literal_int(sbo_bytes, "smem_desc sbo_bytes")
    swz = _literal_int(swizzle, "smem_desc swizzle")
    if lbo % 16 or sbo % 16 or not (0 <= lbo < 1 << 18 and 0 <= sbo < 1 << 18):
        raise TypingError(f"smem_desc: lbo / sbo must be multiples of 16 below 2**18, got "
                          f"{lbo}, {sbo}")
    if swz not in (0, 1):
        raise TypingError(f"smem_desc: swizzle must be 0 (none) or 1 (128-byte), got {swz}")
    high = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (swz << 62)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0],
                               signature.args[1], args[1])
        address = builder.zext(_shared_address(builder, ptr), _I64)
        field = builder.and_(builder.lshr(address, ir.Constant(_I64, 4)),
                             ir.Constant(_I64, 0x3FFF))
        return builder.or_(field, ir.Constant(_I64, high))

    return types.uint64(smem, offset, lbo_bytes, sbo_bytes, swizzle), codegen


def _accumulator_pointers(context, builder, array_type, array_value, count):
    array = context.make_array(array_type)(context, builder, array_value)
    return [builder.gep(array.data, [ir.Constant(_I64, i)]) for i in range(count)]


def _check_accumulator(acc, name):
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
        raise TypingError(f"{name}: acc must be a float32 local array, got {acc}")


@intrinsic
def wgmma_m64k16(typingctx, acc, desc_a, desc_b, accumulate, n, is_bf16, trans_a, trans_b):
    """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{f16|bf16}``: acc (a float32 local array
    of ``n // 2``, updated in place) = A (64x16) @ B (16xn) [+ acc when ``accumulate`` != 0].

    ``n`` (8..256, multiple of 8), ``is_bf16``, ``trans_a`` / ``trans_b`` (0: the operand is
    K-major in shared memory, 1: M- / N-major) are compile-time integers. The accumulator
    registers belong to the Tensor Cores until ``wgmma_wait`` says the group is done."""
    _check_accumulator(acc, "wgmma_m64k16")
    width = _literal_int(n, "wgmma_m64k16 n")
    bf16 = _literal_int(is_bf16, "wgmma_m64k16 is_bf16")
    ta = _literal_int(trans_a, "wgmma_m64k16 trans_a")
    tb = _literal_int(trans_b, "wgmma_m64k16 trans_b")
    if width % 8 or not 8 <= width <= 256 or ta not in (0, 1) or tb not in (0, 1):
        raise TypingError(f"wgmma_m64k16: n must be a multiple of 8 in [8, 256] and the "
                          f"transposes 0 or 1, got n={width}, trans=({ta}, {tb})")
    regs = width // 2
    kind = "bf16" if bf16 else "f16"
    outs = ",".join(f"${i}" for i in range(regs))
    text = ("{ .reg .pred p; "
            f"setp.ne.b32 p, ${regs + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.{kind}.{kind} "
            f"{{{outs}}}, ${regs}, ${regs + 1}, p, 1, 1, {ta}, {tb}; }}")
    # outputs, the two descriptors and scale-d, then inputs tied to the outputs (CUDA C's "+f")
    constraints = ",".join(["=f"] * regs + ["l", "l", "r"] + [str(i) for i in range(regs)]
                           + ["~{memory}"])

    def codegen(context, builder, signature, args):
        ptrs = _accumulator_pointers(context, builder, signature.args[0], args[0], regs)
        values = [builder.load(p) for p in ptrs]
        da = context.cast(builder, args[1], signature.args[1], types.uint64)
        db = context.cast(builder, args[2], signature.args[2], types.uint64)
        scale = context.cast(builder, args[3], signature.args[3], types.int32)
        out = _asm(builder, ir.LiteralStructType([_F32] * regs), [_I64, _I64, _I32]
                   + [_F32] * regs, text, constraints, [da, db, scale] + values,
                   side_effect=True)
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(out, i), p)
        return context.get_dummy_value()

    return types.void(acc, desc_a, desc_b, accumulate, n, is_bf16, trans_a, trans_b), codegen


@intrinsic
def wgmma_wait(typingctx, acc, n_regs, pending):
    """``wgmma.wait_group pending``: at most ``pending`` committed groups still run. The first
    ``n_regs`` accumulator registers are threaded through the asm (tied operands), so no read
    of them can be scheduled above the wait. ``n_regs`` and ``pending`` are compile-time
    integers."""
    _check_accumulator(acc, "wgmma_wait")
    regs = _literal_int(n_regs, "wgmma_wait n_regs")
    count = _literal_int(pending, "wgmma_wait pending")
    constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["~{memory}"])

    def codegen(context, builder, signature, args):
        ptrs = _accumulator_pointers(context, builder, signature.args[0], args[0], regs)
        values = [builder.load(p) for p in ptrs]
        out = _asm(builder, ir.LiteralStructType([_F32] * regs), [_F32] * regs,
                   f"wgmma.wait_group.sync.aligned {count};", constraints, values,
                   side_effect=True)
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(out, i), p)
        return context.get_dummy_value()

    return types.void(acc, n_regs, pending), codegen


__all__ += ["wgmma_fence", "wgmma_commit", "fence_proxy_async", "shared_address", "smem_desc",
            "wgmma_m64k16", "wgmma_wait"]


# --------------------------------------------------------------------------------------------
# Hopper asynchronous copies and barriers (sm_90): mbarrier objects in shared memory, 1-D bulk
# copies global -> shared that complete on an mbarrier, warpgroup register reallocation, named
# barriers and warp leader election.
#
# An mbarrier is one 8-byte word of shared memory: ``(array, element_offset)`` with an array of
# an 8-byte dtype (uint64 / int64), so it is 8-byte aligned. A phase completes when its pending
# arrivals (``count`` from ``mbarrier_init``) reach zero and its transaction count (bytes
# announced by ``*_expect_tx``, less bytes delivered by ``cp_async_bulk_g2s``) is zero; then the
# phase parity flips and the next phase starts with ``count`` arrivals pending. Waits name the
# phase by its parity: ``mbarrier_wait_parity(bar, i, p)`` returns once the phase of parity p
# has completed (a fresh barrier is in phase 0, so waiting on parity 1 passes at once).
# --------------------------------------------------------------------------------------------

#: Largest arrival count of an mbarrier and largest transaction count of one phase (PTX ISA).
MBARRIER_MAX_COUNT = (1 << 20) - 1
#: ``setmaxnreg``'s register counts: multiples of 8 in this range.
SETMAXNREG_RANGE = (24, 256)


def _check_mbarrier(bar, offset, name):
    _check_memory_operand(bar, offset, f"{name} mbarrier")
    if not (isinstance(bar.dtype, types.Integer) and bar.dtype.bitwidth == 64):
        raise TypingError(f"{name}: the mbarrier must be an element of an 8-byte integer array "
                          f"in shared memory (uint64 or int64), got {bar}")


def _mbarrier_address(context, builder, signature, args, first=0):
    ptr = _element_pointer(context, builder, signature.args[first], args[first],
                           signature.args[first + 1], args[first + 1])
    return _shared_address(builder, ptr)


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


def _check_count(value, name, what, low, high):
    """An integer operand (else TypingError); for a literal out of [low, high], the problem."""
    if not isinstance(value, types.Integer):
        raise TypingError(f"{name}: {what} must be an integer, got {value}")
    if isinstance(value, types.IntegerLiteral) and not low <= value.literal_value <= high:
        return f"{name}: {what} must be in [{low}, {high}], got {value.literal_value}"
    return None


@_literal_first_intrinsic
def mbarrier_init(typingctx, bar, offset, count):
    """``mbarrier.init.shared::cta.b64``: phase 0, ``count`` (1..2**20 - 1) arrivals per phase,
    no transactions pending. One thread initialises; then ``fence_mbarrier_init`` and a
    ``cuda.syncthreads()`` before any thread (or bulk copy) uses the barrier."""
    _check_mbarrier(bar, offset, "mbarrier_init")
    problem = _check_count(count, "mbarrier_init", "count", 1, MBARRIER_MAX_COUNT)

    def codegen(context, builder, signature, args):
        n = context.cast(builder, args[2], signature.args[2], types.uint32)
        _asm(builder, ir.VoidType(), [_I32, _I32], "mbarrier.init.shared::cta.b64 [$0], $1;",
             "r,r,~{memory}", [_mbarrier_address(context, builder, signature, args), n],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(bar, offset, count), _unless(problem, codegen)


fence_mbarrier_init = _make_plain(
    "fence.mbarrier_init.release.cluster;", "fence_mbarrier_init",
    "Releases this thread's earlier ``mbarrier_init``s so that other threads and the async "
    "proxy (bulk copies completing on the barrier) see them initialised; follow it with "
    "``cuda.syncthreads()``.")


@intrinsic
def mbarrier_arrive(typingctx, bar, offset):
    """``mbarrier.arrive.shared::cta.b64`` (release, CTA scope): one arrival; returns the state
    token (uint64) of the phase arrived on, for ``mbarrier_try_wait``."""
    _check_mbarrier(bar, offset, "mbarrier_arrive")

    def codegen(context, builder, signature, args):
        return _asm(builder, _I64, [_I32], "mbarrier.arrive.shared::cta.b64 $0, [$1];",
                    "=l,r,~{memory}", [_mbarrier_address(context, builder, signature, args)],
                    side_effect=True)

    return types.uint64(bar, offset), codegen


@_literal_first_intrinsic
def mbarrier_arrive_expect_tx(typingctx, bar, offset, nbytes):
    """``mbarrier.arrive.expect_tx.shared::cta.b64``: add ``nbytes`` (0..2**20 - 1) to the
    current phase's transaction count, then arrive once; returns the state token. The producer
    calls it once per stage with the bytes of every bulk copy it issues on that stage."""
    _check_mbarrier(bar, offset, "mbarrier_arrive_expect_tx")
    problem = _check_count(nbytes, "mbarrier_arrive_expect_tx", "nbytes", 0,
                           MBARRIER_MAX_COUNT)

    def codegen(context, builder, signature, args):
        n = context.cast(builder, args[2], signature.args[2], types.uint32)
        return _asm(builder, _I64, [_I32, _I32],
                    "mbarrier.arrive.expect_tx.shared::cta.b64 $0, [$1], $2;", "=l,r,r,~{memory}",
                    [_mbarrier_address(context, builder, signature, args), n], side_effect=True)

    return types.uint64(bar, offset, nbytes), _unless(problem, codegen)


@_literal_first_intrinsic
def mbarrier_expect_tx(typingctx, bar, offset, nbytes):
    """``mbarrier.expect_tx.relaxed.cta.shared::cta.b64``: add ``nbytes`` to the current phase's
    transaction count without arriving (more copies on a phase already announced)."""
    _check_mbarrier(bar, offset, "mbarrier_expect_tx")
    problem = _check_count(nbytes, "mbarrier_expect_tx", "nbytes", 0, MBARRIER_MAX_COUNT)

    def codegen(context, builder, signature, args):
        n = context.cast(builder, args[2], signature.args[2], types.uint32)
        _asm(builder, ir.VoidType(), [_I32, _I32],
             "mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$0], $1;", "r,r,~{memory}",
             [_mbarrier_address(context, builder, signature, args), n], side_effect=True)
        return context.get_dummy_value()

    return types.void(bar, offset, nbytes), _unless(problem, codegen)


def _try_wait_codegen(kind, operand_type, llvm_type, constraint):
    """Codegen of a ``mbarrier.try_wait{kind}`` returning a boolean, on the 8-byte-word operand
    (the parity, or an arrive's state token) given as ``operand_type``."""
    text = (f"{{ .reg .pred p; mbarrier.try_wait{kind}.shared::cta.b64 p, [$1], $2; "
            "selp.u32 $0, 1, 0, p; }")

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], operand_type)
        done = _asm(builder, _I32, [_I32, llvm_type], text, f"=r,r,{constraint},~{{memory}}",
                    [_mbarrier_address(context, builder, signature, args), value],
                    side_effect=True)
        return builder.icmp_unsigned("!=", done, ir.Constant(_I32, 0))

    return codegen


def _check_parity(parity, name):
    if not isinstance(parity, types.Integer):
        raise TypingError(f"{name}: parity must be an integer (0 or 1), got {parity}")
    if isinstance(parity, types.IntegerLiteral) and parity.literal_value not in (0, 1):
        return f"{name}: parity must be 0 or 1, got {parity.literal_value}"
    return None


@_literal_first_intrinsic
def mbarrier_try_wait_parity(typingctx, bar, offset, parity):
    """``mbarrier.try_wait.parity.shared::cta.b64`` (acquire, CTA scope): True once the phase
    of parity ``parity`` (0 or 1) has completed. The thread may be suspended for a while (a
    hardware time limit) before it answers False; loop on it, or use ``mbarrier_wait_parity``."""
    _check_mbarrier(bar, offset, "mbarrier_try_wait_parity")
    problem = _check_parity(parity, "mbarrier_try_wait_parity")
    codegen = _try_wait_codegen(".parity", types.uint32, _I32, "r")
    return types.boolean(bar, offset, parity), _unless(problem, codegen)


@_literal_first_intrinsic
def mbarrier_wait_parity(typingctx, bar, offset, parity):
    """Wait until the phase of parity ``parity`` (0 or 1) has completed: a ``try_wait.parity``
    loop inside one asm block (acquire, CTA scope), so the data the phase guarded (bulk-copied
    tiles, a consumer's release of a stage) is visible after it."""
    _check_mbarrier(bar, offset, "mbarrier_wait_parity")
    problem = _check_parity(parity, "mbarrier_wait_parity")

    def codegen(context, builder, signature, args):
        p = context.cast(builder, args[2], signature.args[2], types.uint32)
        # ${:uid}: a label unique to each inlined copy of the asm
        _asm(builder, ir.VoidType(), [_I32, _I32],
             "{ .reg .pred p; LLM_MBAR_WAIT_${:uid}: "
             "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
             "@!p bra LLM_MBAR_WAIT_${:uid}; }", "r,r,~{memory}",
             [_mbarrier_address(context, builder, signature, args), p], side_effect=True)
        return context.get_dummy_value()

    return types.void(bar, offset, parity), _unless(problem, codegen)


@intrinsic
def mbarrier_try_wait(typingctx, bar, offset, token):
    """``mbarrier.try_wait.shared::cta.b64`` with a state token from ``mbarrier_arrive`` /
    ``mbarrier_arrive_expect_tx``: True once the phase that token was taken in has completed."""
    _check_mbarrier(bar, offset, "mbarrier_try_wait")
    if not isinstance(token, types.Integer):
        raise TypingError(f"mbarrier_try_wait: token must be the uint64 state returned by an "
                          f"arrive, got {token}")
    return types.boolean(bar, offset, token), _try_wait_codegen("", types.uint64, _I64, "l")


@_literal_first_intrinsic
def cp_async_bulk_g2s(typingctx, smem, smem_offset, gmem, gmem_offset, nbytes, bar, bar_offset):
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes``: copy ``nbytes``
    contiguous bytes from ``gmem[gmem_offset:]`` to ``smem[smem_offset:]`` in the background;
    on arrival they count against the transaction count of the mbarrier ``bar[bar_offset]``'s
    current phase (announce them first with ``mbarrier_arrive_expect_tx``).

    Both addresses must be 16-byte aligned and ``nbytes`` a positive multiple of 16 (a literal
    ``nbytes`` is checked here; the simulator twin checks every copy). The destination is this
    CTA's shared memory (a ``shared::cta`` address is a valid ``shared::cluster`` one)."""
    name = "cp_async_bulk_g2s"
    _check_memory_operand(smem, smem_offset, f"{name} smem")
    _check_memory_operand(gmem, gmem_offset, f"{name} gmem")
    _check_mbarrier(bar, bar_offset, name)
    if not isinstance(nbytes, types.Integer):
        raise TypingError(f"{name}: nbytes must be an integer, got {nbytes}")
    problem = None
    if isinstance(nbytes, types.IntegerLiteral):
        n = nbytes.literal_value
        if n <= 0 or n % 16 or n > MBARRIER_MAX_COUNT:
            problem = (f"{name}: nbytes must be a positive multiple of 16 of at most "
                       f"{MBARRIER_MAX_COUNT} (one phase's transaction count), got {n}")
    for what, array in (("smem", smem), ("gmem", gmem)):
        if array.layout not in ("C", "F"):
            raise TypingError(f"{name}: {what} must be a contiguous array (the copy is one "
                              f"run of bytes from an element offset), got {array}")

    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32, _I32],
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
             "[$0], [$1], $2, [$3];", "r,l,r,r,~{memory}",
             _copy_operands(context, builder, signature, args)
             + [_mbarrier_address(context, builder, signature, args, first=5)],
             side_effect=True)
        return context.get_dummy_value()

    return (types.void(smem, smem_offset, gmem, gmem_offset, nbytes, bar, bar_offset),
            _unless(problem, codegen))


def _make_setmaxnreg(action):
    name = f"setmaxnreg_{action}"

    @intrinsic
    def setmaxnreg(typingctx, count):
        regs = _literal_int(count, f"{name} count")
        low, high = SETMAXNREG_RANGE
        if regs % 8 or not low <= regs <= high:
            raise TypingError(f"{name}: count must be a multiple of 8 in [{low}, {high}], got "
                              f"{regs}")

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), [], f"setmaxnreg.{action}.sync.aligned.u32 {regs};",
                 "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return types.void(count), codegen

    setmaxnreg.__name__ = name
    return setmaxnreg


#: ``setmaxnreg.inc`` / ``.dec.sync.aligned.u32 count`` (sm_90a): every thread of a warpgroup
#: executes the same one, with ``count`` a compile-time multiple of 8 in [24, 256]: the
#: warpgroup's registers per thread grow to (``inc``, waiting for registers freed by a ``dec``)
#: or shrink to ``count``. ptxas honours it only in a kernel with both a max-threads and a
#: min-blocks bound (``launch_bounds=(threads, 1)``) that it compiles as a whole program, as
#: numba's default LTO link does; otherwise it drops it with an info line (C7508 without the
#: bounds, C7504 for relocatable PTX), which the compile check reports (benchmarks/NOTES.md).
setmaxnreg_inc = _make_setmaxnreg("inc")
setmaxnreg_dec = _make_setmaxnreg("dec")


def _check_named_barrier(barrier_id, count, name):
    if not isinstance(barrier_id, types.Integer):
        raise TypingError(f"{name}: barrier_id must be an integer (0..15), got {barrier_id}")
    if not isinstance(count, types.Integer):
        raise TypingError(f"{name}: count must be an integer (threads, a multiple of 32), got "
                          f"{count}")
    if isinstance(barrier_id, types.IntegerLiteral) and not 0 <= barrier_id.literal_value < 16:
        return f"{name}: barrier_id must be in [0, 15], got {barrier_id.literal_value}"
    if isinstance(count, types.IntegerLiteral) and (count.literal_value % 32
                                                    or count.literal_value <= 0):
        return (f"{name}: count must be a positive multiple of 32 (whole warps), got "
                f"{count.literal_value}")
    return None


def _make_named_barrier(kind):
    name = f"named_barrier_{kind}"

    @_literal_first_intrinsic
    def named_barrier(typingctx, barrier_id, count):
        problem = _check_named_barrier(barrier_id, count, name)

        def codegen(context, builder, signature, args):
            i = context.cast(builder, args[0], signature.args[0], types.uint32)
            n = context.cast(builder, args[1], signature.args[1], types.uint32)
            _asm(builder, ir.VoidType(), [_I32, _I32], f"bar.{kind} $0, $1;", "r,r,~{memory}",
                 [i, n], side_effect=True)
            return context.get_dummy_value()

        return types.void(barrier_id, count), _unless(problem, codegen)

    named_barrier.__name__ = name
    return named_barrier


#: ``bar.sync id, count`` / ``bar.arrive id, count``: hardware barrier ``id`` (1..15; 0 is
#: ``cuda.syncthreads``'s) completes when ``count`` threads (whole warps) have reached it;
#: ``sync`` waits for that, ``arrive`` does not (a producer signalling consumers). Lets a
#: subset of warps (one warpgroup, the consumers) synchronise without the others.
named_barrier_sync = _make_named_barrier("sync")
named_barrier_arrive = _make_named_barrier("arrive")


@intrinsic
def elect_sync(typingctx):
    """``elect.sync`` over the full warp: True in exactly one lane (the leader), False in the
    other 31; every lane of the warp must execute it (a converged warp). Picks the lane that
    issues a warp's bulk copies and expect_tx (one ``ELECT`` instruction)."""
    def codegen(context, builder, signature, args):
        elected = _asm(builder, _I32, [],
                       "{ .reg .pred p; .reg .b32 r; elect.sync r|p, 0xffffffff; "
                       "selp.u32 $0, 1, 0, p; }", "=r", [], side_effect=True)
        return builder.icmp_unsigned("!=", elected, ir.Constant(_I32, 0))

    return types.boolean(), codegen


__all__ += ["mbarrier_init", "fence_mbarrier_init", "mbarrier_arrive",
            "mbarrier_arrive_expect_tx", "mbarrier_expect_tx", "mbarrier_try_wait_parity",
            "mbarrier_wait_parity", "mbarrier_try_wait", "cp_async_bulk_g2s",
            "setmaxnreg_inc", "setmaxnreg_dec", "named_barrier_sync", "named_barrier_arrive",
            "elect_sync"]


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
