"""Threads working together: warp shuffles, ``syncwarp`` and leader election; named barriers
(a subset of the block's warps) and ``setmaxnreg`` (a warpgroup's register reallocation); grids
working together: programmatic dependent launch's ``griddepcontrol``."""

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

from .common import _F32, _I32, _asm, _literal_first_intrinsic, _literal_int, _unless

__all__ = ["shfl_xor_f32", "shfl_xor_i32", "shfl_idx_i32", "vote_any", "syncwarp", "elect_sync",
           "named_barrier_sync", "named_barrier_arrive", "setmaxnreg_inc", "setmaxnreg_dec",
           "griddep_wait", "griddep_launch_dependents"]


# --------------------------------------------------------------------------------------------
# Warp collectives
# --------------------------------------------------------------------------------------------

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


@intrinsic
def vote_any(typingctx, predicate):
    """``vote.sync.any.pred`` over the full warp: True in every lane when ``predicate`` (a
    boolean) holds in any lane. Every lane must execute it (a converged warp); the result is
    warp-uniform, so a branch on it does not diverge."""
    if not isinstance(predicate, types.Boolean):
        raise TypingError(f"vote_any: predicate must be a boolean, got {predicate}")

    def codegen(context, builder, signature, args):
        flag = builder.zext(args[0], _I32)
        voted = _asm(builder, _I32, [_I32],
                     "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; "
                     "vote.sync.any.pred q, p, 0xffffffff; selp.u32 $0, 1, 0, q; }",
                     "=r,r", [flag], side_effect=True)
        return builder.icmp_unsigned("!=", voted, ir.Constant(_I32, 0))

    return types.boolean(predicate), codegen


@intrinsic
def syncwarp(typingctx):
    def codegen(context, builder, signature, args):
        _asm(builder, ir.VoidType(), [], "bar.warp.sync 0xffffffff;", "~{memory}", [],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(), codegen


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


# --------------------------------------------------------------------------------------------
# Named barriers and warpgroup register reallocation (sm_90)
# --------------------------------------------------------------------------------------------

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


#: ``setmaxnreg``'s register counts: multiples of 8 in this range.
SETMAXNREG_RANGE = (24, 256)


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


# --------------------------------------------------------------------------------------------
# Programmatic dependent launch (sm_90): a kernel launched with the programmatic
# stream-serialization attribute (``Kernel(..., programmatic=True)``) may start while the
# kernel before it on the stream still runs
# --------------------------------------------------------------------------------------------

def _make_griddepcontrol(action, doc):
    @intrinsic
    def griddep(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), [], f"griddepcontrol.{action};", "~{memory}", [],
                 side_effect=True)
            return context.get_dummy_value()

        return types.void(), codegen

    griddep.__doc__ = doc
    return griddep


griddep_wait = _make_griddepcontrol(
    "wait", "``griddepcontrol.wait``: block until every grid this one depends on has completed "
    "and its memory is visible. A programmatic kernel runs it before touching anything the "
    "previous kernel writes or reads; without the launch attribute it returns at once.")
griddep_launch_dependents = _make_griddepcontrol(
    "launch_dependents", "``griddepcontrol.launch_dependents``: this block no longer holds back "
    "the next programmatic kernel's launch (it starts once every block has run this or exited; "
    "it still waits for this grid's completion at its own ``griddep_wait``).")
