"""Hopper warpgroup MMA (``wgmma.mma_async``, sm_90a): shared-memory matrix descriptors, the
MMA itself (fp16 / bf16 with A from shared memory or from registers; FP8 E4M3 from shared
memory), its fences, commit and wait."""

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

from .common import (_F32, _I32, _I64, _asm, _check_memory_operand, _element_pointer,
                     _literal_int, _make_plain, _shared_address)

__all__ = ["wgmma_fence", "wgmma_commit", "fence_proxy_async", "smem_desc", "smem_desc_advance",
           "wgmma_m64k16",
           "wgmma_m64k16_rs", "wgmma_m64k32_e4m3", "wgmma_wait"]


# --------------------------------------------------------------------------------------------
# Hopper warpgroup MMA (wgmma.mma_async, sm_90a): A and B from shared-memory descriptors,
# f32 accumulators in registers. One warpgroup (4 consecutive warps, 128 threads) issues it
# together; the accumulator fragment of m64nNk16 is, for warp w of the group and lane l,
# register i -> row 16w + l/4 + 8 * ((i/2) % 2), column 8 * (i/4) + 2 * (l%4) + i%2.
# --------------------------------------------------------------------------------------------

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


@intrinsic
def smem_desc_advance(typingctx, desc, byte_offset):
    """The descriptor ``desc`` moved ``byte_offset`` bytes further (a multiple of 16, 0 to
    2**18: 16-byte units added to the address field; the tile must still end below 256 KB, so
    nothing carries out of the field). Descriptors of a tile's k-steps and stages built from one
    ``smem_desc`` this way cost one integer add each where ``smem_desc`` costs an address
    computation, a shift and two masks (offline sm_90a: 11 instructions a wgmma in the attention
    kernel's issue loop before, 2-3 after). ``byte_offset`` may be a run-time value."""
    if not isinstance(desc, types.Integer) or not isinstance(byte_offset, types.Integer):
        raise TypingError(f"smem_desc_advance: (uint64 descriptor, integer offset) expected, "
                          f"got ({desc}, {byte_offset})")

    def codegen(context, builder, signature, args):
        d = context.cast(builder, args[0], signature.args[0], types.uint64)
        off = context.cast(builder, args[1], signature.args[1], types.uint64)
        return builder.add(d, builder.lshr(off, ir.Constant(_I64, 4)))

    return types.uint64(desc, byte_offset), codegen


def _accumulator_pointers(context, builder, array_type, array_value, count):
    array = context.make_array(array_type)(context, builder, array_value)
    return [builder.gep(array.data, [ir.Constant(_I64, i)]) for i in range(count)]


def _check_accumulator(acc, name):
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
        raise TypingError(f"{name}: acc must be a float32 local array, got {acc}")


def _descriptor_mma(shape_types, regs, tail):
    """Codegen of ``wgmma.mma_async.sync.aligned.<shape_types>`` with both operands from
    shared-memory descriptors, ``regs`` f32 accumulators updated in place (args: acc, desc_a,
    desc_b, scale-d != 0, ...) and ``tail`` after the operands (the transpose immediates)."""
    outs = ",".join(f"${i}" for i in range(regs))
    text = ("{ .reg .pred p; "
            f"setp.ne.b32 p, ${regs + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.{shape_types} "
            f"{{{outs}}}, ${regs}, ${regs + 1}, p, 1, 1{tail}; }}")
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

    return codegen


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
    kind = "bf16" if bf16 else "f16"
    codegen = _descriptor_mma(f"m64n{width}k16.f32.{kind}.{kind}", width // 2, f", {ta}, {tb}")
    return types.void(acc, desc_a, desc_b, accumulate, n, is_bf16, trans_a, trans_b), codegen


@intrinsic
def wgmma_m64k32_e4m3(typingctx, acc, desc_a, desc_b, accumulate, n):
    """``wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3``: acc (a float32 local array
    of ``n // 2``, updated in place) = A (64x32) @ B (32xn) [+ acc when ``accumulate`` != 0],
    both operands FP8 E4M3 codes, K-major in shared memory (the only layout 8-bit wgmma
    reads): a k32 step is 32 bytes along a row, as a k16 step of b16 data. ``n`` (8..256,
    multiple of 8) is a compile-time integer; the accumulator fragment is ``wgmma_m64k16``'s."""
    _check_accumulator(acc, "wgmma_m64k32_e4m3")
    width = _literal_int(n, "wgmma_m64k32_e4m3 n")
    if width % 8 or not 8 <= width <= 256:
        raise TypingError(f"wgmma_m64k32_e4m3: n must be a multiple of 8 in [8, 256], got "
                          f"n={width}")
    codegen = _descriptor_mma(f"m64n{width}k32.f32.e4m3.e4m3", width // 2, "")
    return types.void(acc, desc_a, desc_b, accumulate, n), codegen


@intrinsic
def wgmma_m64k16_rs(typingctx, acc, a0, a1, a2, a3, desc_b, accumulate, n, is_bf16, trans_b):
    """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{f16|bf16}`` with A from registers: acc
    (a float32 local array of ``n // 2``, updated in place) = A (64x16) @ B (16xn) [+ acc when
    ``accumulate`` != 0], B from the shared-memory descriptor ``desc_b``.

    A's fragment: warp w of the warpgroup holds rows ``16w .. 16w + 15`` in the layout of an
    ``mma.sync`` m16n8k16 A operand (``a0..a3``: packed b16 pairs, ``ptx/__init__.py``), which
    is also where the accumulator of an earlier wgmma puts those rows: ``acc[8j .. 8j + 7]``
    packed in pairs are the A fragment of columns ``16j .. 16j + 15`` (P of attention goes from
    one MMA's output to the next one's input without shared memory).

    ``n`` (8..256, multiple of 8), ``is_bf16`` and ``trans_b`` (0: B K-major, 1: N-major) are
    compile-time integers. The A registers are read asynchronously: ptxas keeps them until the
    ``wgmma_wait`` that retires the group."""
    _check_accumulator(acc, "wgmma_m64k16_rs")
    width = _literal_int(n, "wgmma_m64k16_rs n")
    bf16 = _literal_int(is_bf16, "wgmma_m64k16_rs is_bf16")
    tb = _literal_int(trans_b, "wgmma_m64k16_rs trans_b")
    if width % 8 or not 8 <= width <= 256 or tb not in (0, 1):
        raise TypingError(f"wgmma_m64k16_rs: n must be a multiple of 8 in [8, 256] and trans_b "
                          f"0 or 1, got n={width}, trans_b={tb}")
    for name, a in (("a0", a0), ("a1", a1), ("a2", a2), ("a3", a3)):
        if not isinstance(a, types.Integer):
            raise TypingError(f"wgmma_m64k16_rs: {name} must be a uint32 (two packed b16), "
                              f"got {a}")
    regs = width // 2
    kind = "bf16" if bf16 else "f16"
    outs = ",".join(f"${i}" for i in range(regs))
    a_regs = ",".join(f"${regs + i}" for i in range(4))
    text = ("{ .reg .pred p; "
            f"setp.ne.b32 p, ${regs + 5}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.{kind}.{kind} "
            f"{{{outs}}}, {{{a_regs}}}, ${regs + 4}, p, 1, 1, {tb}; }}")
    constraints = ",".join(["=f"] * regs + ["r"] * 4 + ["l", "r"]
                           + [str(i) for i in range(regs)] + ["~{memory}"])

    def codegen(context, builder, signature, args):
        ptrs = _accumulator_pointers(context, builder, signature.args[0], args[0], regs)
        values = [builder.load(p) for p in ptrs]
        a = [context.cast(builder, args[1 + i], signature.args[1 + i], types.uint32)
             for i in range(4)]
        db = context.cast(builder, args[5], signature.args[5], types.uint64)
        scale = context.cast(builder, args[6], signature.args[6], types.int32)
        out = _asm(builder, ir.LiteralStructType([_F32] * regs), [_I32] * 4 + [_I64, _I32]
                   + [_F32] * regs, text, constraints, a + [db, scale] + values,
                   side_effect=True)
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(out, i), p)
        return context.get_dummy_value()

    return (types.void(acc, a0, a1, a2, a3, desc_b, accumulate, n, is_bf16, trans_b),
            codegen)


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
