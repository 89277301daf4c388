"""The linked backend: mma, ldmatrix and cp.async as CUDA C inline asm, linked into kernels
through ``cuda.declare_device`` and inlined by nvJitLink's LTO.

Selected by ``LLMSPEED_NUMBA_PTX_BACKEND=linked`` (see ``ptx/__init__.py``); it overrides only
those ops, the rest stay intrinsics. It exists to compare against the default ``@intrinsic``
backend (which inlines without LTO and keeps kernels cacheable: linked code cannot be pickled into
numba's disk cache). Results must be bit-identical between the two (GPU test).

Rules from NUMBA_NOTES.md: one ``CUSource`` object for all functions (the same text in two objects
is "multiply defined"); no ``__half`` by-value parameters (they block inlining), so halves travel
as ``unsigned``; numba ABI: ``int f(T* ret, args...)`` returning 0.
"""

from numba import cuda, types
from numba.cuda.extending import intrinsic

from ._intrinsics.common import _I64, _check_memory_operand, _element_pointer
from ._intrinsics.memory import shared_address

_SOURCE = r"""
struct llm_f32x4 { float v[4]; };
struct llm_u32x2 { unsigned v[2]; };
struct llm_u32x4 { unsigned v[4]; };

#define LLM_MMA(NAME, T)                                                                     \
extern "C" __device__ int NAME(llm_f32x4* d, unsigned a0, unsigned a1, unsigned a2,         \
                               unsigned a3, unsigned b0, unsigned b1, float c0, float c1,    \
                               float c2, float c3) {                                         \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 "                  \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                 \
                 : "=f"(d->v[0]), "=f"(d->v[1]), "=f"(d->v[2]), "=f"(d->v[3])                \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),                     \
                   "f"(c0), "f"(c1), "f"(c2), "f"(c3));                                      \
    return 0;                                                                                \
}
LLM_MMA(llm_mma_f16, "f16")
LLM_MMA(llm_mma_bf16, "bf16")

extern "C" __device__ int llm_ldsm_x1(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(*r) : "r"(addr));
    return 0;
}
extern "C" __device__ int llm_ldsm_x1_t(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                 : "=r"(*r) : "r"(addr));
    return 0;
}
extern "C" __device__ int llm_ldsm_x2(llm_u32x2* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r->v[0]), "=r"(r->v[1]) : "r"(addr));
    return 0;
}
extern "C" __device__ int llm_ldsm_x2_t(llm_u32x2* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r->v[0]), "=r"(r->v[1]) : "r"(addr));
    return 0;
}
extern "C" __device__ int llm_ldsm_x4(llm_u32x4* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r->v[0]), "=r"(r->v[1]), "=r"(r->v[2]), "=r"(r->v[3]) : "r"(addr));
    return 0;
}
extern "C" __device__ int llm_ldsm_x4_t(llm_u32x4* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r->v[0]), "=r"(r->v[1]), "=r"(r->v[2]), "=r"(r->v[3]) : "r"(addr));
    return 0;
}
extern "C" __device__ int llm_cp_async_16(int* unused, unsigned dst, unsigned long long src,
                                          unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
    return 0;
}
extern "C" __device__ int llm_cp_async_commit(int* unused) {
    asm volatile("cp.async.commit_group;" ::: "memory");
    return 0;
}
"""

_LINK = cuda.CUSource(_SOURCE)
_U32 = types.uint32
_F32 = types.float32


def _declare(name, signature):
    return cuda.declare_device(name, signature, link=[_LINK])


_mma_f16 = _declare("llm_mma_f16", types.UniTuple(_F32, 4)(*([_U32] * 6 + [_F32] * 4)))
_mma_bf16 = _declare("llm_mma_bf16", types.UniTuple(_F32, 4)(*([_U32] * 6 + [_F32] * 4)))
_ldsm_x1 = _declare("llm_ldsm_x1", _U32(_U32))
_ldsm_x1_t = _declare("llm_ldsm_x1_t", _U32(_U32))
_ldsm_x2 = _declare("llm_ldsm_x2", types.UniTuple(_U32, 2)(_U32))
_ldsm_x2_t = _declare("llm_ldsm_x2_t", types.UniTuple(_U32, 2)(_U32))
_ldsm_x4 = _declare("llm_ldsm_x4", types.UniTuple(_U32, 4)(_U32))
_ldsm_x4_t = _declare("llm_ldsm_x4_t", types.UniTuple(_U32, 4)(_U32))
_cp_async = _declare("llm_cp_async_16", types.int32(_U32, types.uint64, _U32))
_cp_commit = _declare("llm_cp_async_commit", types.int32())


@intrinsic
def _global_addr(typingctx, gmem, offset):
    _check_memory_operand(gmem, offset, "global address")

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0],
                               signature.args[1], args[1])
        return builder.ptrtoint(ptr, _I64)

    return types.uint64(gmem, offset), codegen


_inline = cuda.jit(device=True, inline="always")


@_inline
def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma_f16(_U32(a0), _U32(a1), _U32(a2), _U32(a3), _U32(b0), _U32(b1),
                    _F32(c0), _F32(c1), _F32(c2), _F32(c3))


@_inline
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma_bf16(_U32(a0), _U32(a1), _U32(a2), _U32(a3), _U32(b0), _U32(b1),
                     _F32(c0), _F32(c1), _F32(c2), _F32(c3))


@_inline
def ldmatrix_x1(smem, offset):
    return _ldsm_x1(shared_address(smem, offset))


@_inline
def ldmatrix_x1_trans(smem, offset):
    return _ldsm_x1_t(shared_address(smem, offset))


@_inline
def ldmatrix_x2(smem, offset):
    return _ldsm_x2(shared_address(smem, offset))


@_inline
def ldmatrix_x2_trans(smem, offset):
    return _ldsm_x2_t(shared_address(smem, offset))


@_inline
def ldmatrix_x4(smem, offset):
    return _ldsm_x4(shared_address(smem, offset))


@_inline
def ldmatrix_x4_trans(smem, offset):
    return _ldsm_x4_t(shared_address(smem, offset))


@_inline
def cp_async_16(smem, smem_offset, gmem, gmem_offset, src_bytes):
    _cp_async(shared_address(smem, smem_offset), _global_addr(gmem, gmem_offset), _U32(src_bytes))


@_inline
def cp_async_commit():
    _cp_commit()


# cp_async_wait keeps the intrinsic: its N must be a literal inside the asm text.

__all__ = ["mma_f16", "mma_bf16", "ldmatrix_x1", "ldmatrix_x1_trans", "ldmatrix_x2",
           "ldmatrix_x2_trans", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async_16",
           "cp_async_commit"]
