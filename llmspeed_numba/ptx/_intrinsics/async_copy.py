"""Asynchronous copies global -> shared and the barriers they complete on: ``cp.async`` (16 bytes,
commit / wait groups), Hopper mbarriers and ``cp.async.bulk`` (1-D bulk copies that complete on an
mbarrier)."""

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

from .common import (_I32, _I64, _asm, _check_memory_operand, _element_pointer,
                     _literal_first_intrinsic, _make_plain, _shared_address, _unless)

__all__ = [
    "cp_async_16", "cp_async_16_l2", "cp_async_commit", "cp_async_wait",
    "mbarrier_init", "fence_mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx",
    "mbarrier_expect_tx", "mbarrier_try_wait_parity", "mbarrier_wait_parity", "mbarrier_try_wait",
    "cp_async_mbarrier_arrive_noinc", "cp_async_bulk_g2s", "cp_async_bulk_tensor_2d_g2s",
]


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
# Hopper asynchronous copies and barriers (sm_90): mbarrier objects in shared memory, 1-D bulk
# copies global -> shared that complete on an mbarrier.
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


def _check_mbarrier(bar, offset, name):
    _check_memory_operand(bar, offset, f"{name} mbarrier")
    if not (isinstance(bar.dtype, types.Integer) and bar.dtype.bitwidth == 64):
        raise TypingError(f"{name}: the mbarrier must be an element of an 8-byte integer array "
                          f"in shared memory (uint64 or int64), got {bar}")


def _mbarrier_address(context, builder, signature, args, first=0):
    ptr = _element_pointer(context, builder, signature.args[first], args[first],
                           signature.args[first + 1], args[first + 1])
    return _shared_address(builder, ptr)


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


@intrinsic
def cp_async_mbarrier_arrive_noinc(typingctx, bar, offset):
    """``cp.async.mbarrier.arrive.noinc.shared::cta.b64``: the barrier receives one arrival
    when every ``cp.async`` this thread issued before it has landed; the thread does not wait.
    ``.noinc``: the arrival is one of the ``count`` the barrier was initialised with (a
    producer thread announcing its copies of a stage, one arrival a thread). The copies are the
    generic proxy's writes: a consumer that reads them with wgmma fences the async proxy
    (``fence_proxy_async``) after its wait."""
    _check_mbarrier(bar, offset, "cp_async_mbarrier_arrive_noinc")

    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [_I32],
             "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r,~{memory}",
             [_mbarrier_address(context, builder, signature, args)], side_effect=True)

    return types.void(bar, offset), codegen


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


@intrinsic
def cp_async_bulk_tensor_2d_g2s(typingctx, smem, smem_offset, tensor_map, x, y, bar, bar_offset):
    """``cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes``: the
    Tensor Memory Accelerator copies the box at element column ``x``, row ``y`` of the 2-D
    tensor that ``tensor_map`` describes (a 128-byte map in global memory, made by
    ``_tensor_map.tensor_map_2d``; its box shape and swizzle are in the map) to
    ``smem[smem_offset:]`` in the background, elements outside the tensor as zeros; on arrival
    the box's bytes (all of them, filled ones too) count against the transaction count of the
    mbarrier ``bar[bar_offset]``'s current phase (announce them first with
    ``mbarrier_arrive_expect_tx``). One thread issues it for the whole box.

    The shared destination must be 128-byte aligned, 1024-byte aligned for the 128-byte swizzle
    (whose pattern follows address bits 7-9). ``x``, ``y``: int32 coordinates, may be negative
    or past the end (those elements are zero-filled)."""
    name = "cp_async_bulk_tensor_2d_g2s"
    _check_memory_operand(smem, smem_offset, f"{name} smem")
    _check_mbarrier(bar, bar_offset, name)
    if not isinstance(tensor_map, types.Array):
        raise TypingError(f"{name}: tensor_map must be the device array holding the map, got "
                          f"{tensor_map}")
    for what, value in (("x", x), ("y", y)):
        if not isinstance(value, types.Integer):
            raise TypingError(f"{name}: {what} must be an integer, got {value}")

    def codegen(context, builder, signature, args):
        dst = _element_pointer(context, builder, signature.args[0], args[0], signature.args[1],
                               args[1])
        array = context.make_array(signature.args[2])(context, builder, args[2])
        coords = [context.cast(builder, args[i], signature.args[i], types.int32) for i in (3, 4)]
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32, _I32, _I32],
             "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
             "[$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r,~{memory}",
             [_shared_address(builder, dst), builder.ptrtoint(array.data, _I64)] + coords
             + [_mbarrier_address(context, builder, signature, args, first=5)],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(smem, smem_offset, tensor_map, x, y, bar, bar_offset), codegen
