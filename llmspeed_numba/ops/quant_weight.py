"""Weight-only quantized matrices for ``quant_gemm``: quantization at load time, GGUF and GPTQ
blocks, the private packed layout, and ``dequantize`` (the reference every test uses).

A ``QuantizedWeight`` stands for an (N, K) matrix in torch.nn.Linear's layout (out_features x
in_features). Every format is one of two forms, per group of ``group_size`` consecutive k of a
row n (g = k // group_size):

    "offset":  w[n, k] = (q[n, k] - z[g, n]) * s[g, n]       int4 (z = 8 symmetric, or a zero
                                                             point per group), int8 (z = 128),
                                                             GGUF Q4_0 (z = 8), Q8_0 (z = 128),
                                                             GPTQ, AWQ (a zero point per
                                                             group)
    "affine":  w[n, k] = q[n, k] * s[g, n] + m[g, n]         GGUF Q4_1 (m: the block minimum)

with q the unsigned code (4 or 8 bits; signed int8 codes are stored biased by 128), s the scale
(fp16 / bf16 / fp32, the source's dtype), z an integer zero point, m a minimum in the scale's
dtype. ``dequantize`` evaluates these in float32 exactly as written (for Q4_0, Q4_1 and Q8_0 the
result is bit for bit the ``gguf`` package's ``gguf.quants.dequantize``).

Private layout (what the kernels read, ``ops/_quant_kernels.py``): codes in chunks of 16 bytes,
``CHUNK_K`` = 32 k (int4) or 16 k (int8) of one row, stored chunk-major:

    qweight[(c * N + n) * 4 + j], j = 0..3      uint32 word j of chunk c of row n, holding
                                                k = c * CHUNK_K + j * per_word + i at bits
                                                [bits * i, bits * (i + 1)), per_word = 32 / bits

so the 32 threads of a warp, on 32 consecutive rows, read 512 contiguous bytes with one 16-byte
load each. K is padded to a whole chunk (``K_padded``) with zero codes (the kernels read x as
zero there). ``scales``, ``zeros`` (uint8, only with per-group zero points) and ``mins`` (affine
only) are (groups, N), row-major. Quantizing and repacking run on the host with NumPy, once, at
load (``quantize_weight`` of a torch tensor: torch ops on its device, the same bits); the packed
arrays are then copied to the device in the kind asked for (torch, CuPy, numba; NumPy arrays
under the simulator).
"""

import dataclasses
from typing import Any

import numpy as np

from .._arrays import numpy_dtype, to_host
from .._fp8_codec import decode_e4m3
from .._env import SIMULATOR, cuda
from .._typing import ArrayLike

FORMATS = ("int4", "int8", "fp8_e4m3")
GROUP_SIZES = (32, 64, 128, -1)
WEIGHT_DTYPES = ("float16", "bfloat16", "float32")
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
KINDS = ("numba", "torch", "cupy")
#: GGUF's block: 32 values, fp16 scale (and fp16 minimum for Q4_1).
GGUF_BLOCK = 32
_GGUF = {  # name: (bits, zero point (None: affine), bytes per block)
    "Q4_0": (4, 8, 18),
    "Q4_1": (4, None, 20),
    "Q8_0": (8, 128, 34),
}


def chunk_k(bits):
    """k per 16-byte chunk of one row: 32 for int4, 16 for int8."""
    return 4 * (32 // bits)


# ---- host conversions --------------------------------------------------------------------------

def _host(x, name):
    """Host NumPy copy (or view) of a NumPy array, a torch tensor (any device), a CuPy array or a
    numba device array (``_arrays.to_host``); ``TypeError`` naming ``name`` otherwise."""
    try:
        return to_host(x)
    except TypeError:
        raise TypeError(f"{name}: expected a NumPy array, torch tensor, CuPy array or numba "
                        f"device array, got {type(x).__name__}") from None


def _kind_of(x):
    """The device kind an input's packed copy takes: torch for torch tensors, CuPy for CuPy
    arrays, numba otherwise."""
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    return "numba"


def _device_of(x):
    if type(x).__module__.startswith("torch") and x.is_cuda:
        return x.device
    return None


def _synchronize(x):
    """Wait for the work queued on the current stream of ``x``'s device (torch, CuPy; numba's
    copies are synchronous)."""
    module = type(x).__module__
    if module.startswith("torch") and x.is_cuda:
        import torch

        torch.cuda.current_stream(x.device).synchronize()
    elif module.startswith("cupy"):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _place(host, kind, device):
    """A device copy of a host array: NumPy under the simulator; torch (on ``device``, default
    the current CUDA device), CuPy or numba on a GPU. uint32 travels as int32 in torch (the
    kernels read the bits)."""
    host = np.ascontiguousarray(host)
    if SIMULATOR:
        return host.copy()
    if kind == "torch":
        import torch

        if host.dtype == np.uint32:
            host = host.view(np.int32)
        if host.dtype.name == "bfloat16":
            t = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(host)
        return t.to(device or "cuda")
    if kind == "cupy":
        import cupy

        return cupy.asarray(host)
    if host.dtype == np.float16 or host.dtype.name == "bfloat16":
        host = host.view(np.uint16)  # numba arrays hold no bfloat16: the bits (scale_dtype says)
    return cuda.to_device(host)


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


# ---- the private layout ----------------------------------------------------------------------

def pack_codes(q, bits):
    """(N, K) codes (0 .. 2^bits - 1) -> the private chunk-major uint32 layout (flat), K padded
    to a whole chunk with zero codes."""
    n, k = q.shape
    ck = chunk_k(bits)
    per_word = 32 // bits
    kp = -(-k // ck) * ck
    padded = np.zeros((n, kp), np.uint32)
    padded[:, :k] = q
    parts = padded.reshape(n, kp // ck, 4, per_word)
    words = np.zeros((n, kp // ck, 4), np.uint32)
    for i in range(per_word):
        words |= parts[..., i] << np.uint32(bits * i)
    return np.ascontiguousarray(words.transpose(1, 0, 2)).reshape(-1)


def unpack_codes(words, bits, n, k):
    """Inverse of ``pack_codes``: (N, K) uint8 codes."""
    ck = chunk_k(bits)
    per_word = 32 // bits
    kp = -(-k // ck) * ck
    w = np.asarray(words).view(np.uint32).reshape(kp // ck, n, 4).transpose(1, 0, 2)
    mask = np.uint32((1 << bits) - 1)
    parts = np.stack([(w >> np.uint32(bits * i)) & mask for i in range(per_word)], axis=-1)
    return parts.reshape(n, kp)[:, :k].astype(np.uint8)


# ---- the weight ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """An (N, K) weight in a quantized format (see the module docstring); build it with
    ``quantize_weight``, ``QuantizedWeight.from_gguf`` or ``QuantizedWeight.from_gptq``, use it
    with ``quant_gemm``. Fields after ``scales`` are private layout details."""

    format: str            # "int4", "int8", "Q4_0", "Q4_1", "Q8_0", "gptq", "awq"
    shape: tuple           # (N, K)
    group_size: int        # k per group (K itself for one group per row)
    bits: int              # 4 or 8
    scales: object         # (groups, N) device array, the scale dtype
    qweight: object        # flat uint32 (int32 in torch) device array, the private layout
    zero_point: int | None  # the one zero point of every group, or None
    zeros: object          # (groups, N) uint8 device array of zero points, or None
    mins: object           # (groups, N) device array of affine minimums, or None
    scale_dtype: str
    #: (K,) int32 device array or None: the codes' column j is the weight's column
    #: ``k_perm[j]`` (act-order GPTQ, K sorted by group at load); quant_gemm gathers x to match
    k_perm: object = None

    def __post_init__(self):
        # Launched as a programmatic dependent (launch.programmatic), the streaming kernel reads
        # the weight before it waits for the kernel before it: every write of these arrays,
        # torch's quantization kernels included, completes here, once, at load (the arrays
        # share a device: one wait on its current stream covers them all).
        _synchronize(self.qweight)

    @property
    def N(self) -> int:
        return self.shape[0]

    @property
    def K(self) -> int:
        return self.shape[1]

    @property
    def K_padded(self) -> int:
        """K rounded up to a whole 16-byte chunk of codes."""
        ck = chunk_k(self.bits)
        return -(-self.K // ck) * ck

    @property
    def groups(self) -> int:
        return -(-self.K // self.group_size)

    @property
    def mode(self) -> str:
        """"const" (one zero point), "zeros" (a zero point per group) or "affine"."""
        if self.mins is not None:
            return "affine"
        return "const" if self.zeros is None else "zeros"

    @property
    def key(self) -> tuple:
        """Everything about the weight a kernel is specialised or planned on (no data)."""
        return (self.format, self.shape, self.group_size, self.bits, self.zero_point,
                self.mode, self.scale_dtype, self.k_perm is not None)

    @property
    def aux(self):
        """The per-group array beside the scales: zero points, minimums, or None."""
        return self.zeros if self.zeros is not None else self.mins

    def nbytes(self) -> int:
        """Device bytes of the packed weight (codes, scales, zero points / minimums)."""
        n, groups = self.N, self.groups
        aux = 0 if self.aux is None else groups * n * (1 if self.zeros is not None else
                                                       np.dtype(numpy_dtype(self.scale_dtype))
                                                       .itemsize)
        return (self.K_padded * n * self.bits // 8 + aux
                + groups * n * np.dtype(numpy_dtype(self.scale_dtype)).itemsize)

    def codes(self) -> np.ndarray:
        """The (N, K) unsigned codes on the host (uint8), in the stored column order (sorted by
        group when ``k_perm`` is set)."""
        if self.format == "fp8_e4m3":   # e4m3 codes, row-major (``_fp8_quant``)
            return np.ascontiguousarray(_host(self.qweight, "qweight")).reshape(self.N, self.K)
        return unpack_codes(_host(self.qweight, "qweight"), self.bits, self.N, self.K)

    def dequantize(self) -> np.ndarray:
        """The (N, K) float32 matrix this weight represents, on the host (NumPy), computed in
        float32 exactly as the module docstring's formulas are written (columns in the weight's
        own order)."""
        w = self._dequantize_stored()
        if self.k_perm is None:
            return w
        out = np.empty_like(w)
        out[:, _host(self.k_perm, "k_perm")] = w
        return out

    def _dequantize_stored(self):
        if self.format == "fp8_e4m3":
            return decode_e4m3(self.codes()) * self._values(self.scales).T
        q = self.codes().astype(np.float32)
        groups = np.arange(self.K) // self.group_size
        s = self._values(self.scales).T[:, groups]                            # (N, K)
        if self.mode == "affine":
            m = self._values(self.mins).T[:, groups]
            return s * q + m
        if self.mode == "zeros":
            z = _host(self.zeros, "zeros").astype(np.float32).T[:, groups]
        else:
            z = np.float32(self.zero_point)
        return (q - z) * s

    def _values(self, a):
        """A scale-dtype device array on the host as float32 (numba arrays hold half-precision
        values as their uint16 bits)."""
        host = np.ascontiguousarray(_host(a, "scales"))
        dtype = np.dtype(numpy_dtype(self.scale_dtype))
        if host.dtype != dtype:
            host = host.view(dtype)
        return host.astype(np.float32)

    # -- other sources ------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, data: Any, ggml_type: Any, shape: tuple[int, int], *,
                  kind: str = "numba", device: Any = None) -> "QuantizedWeight":
        """A GGUF tensor's raw blocks, kept 4 / 8-bit (repacked, not re-quantized).

        data: uint8, the blocks as ``gguf.GGUFReader`` gives them ((N, row bytes), or flat;
        NumPy, torch or any host-readable array). ggml_type: Q4_0, Q4_1 or Q8_0, as a
        ``gguf.GGMLQuantizationType`` or its name. shape: (N, K), K a multiple of 32.
        kind / device: where the packed copy goes ("numba", "torch" on ``device``, "cupy").
        Raises ValueError for another type, a bad shape, or data of the wrong size; TypeError
        for data that is not uint8."""
        _check_kind(kind)
        name = getattr(ggml_type, "name", ggml_type)
        if not isinstance(name, str) or name.upper() not in _GGUF:
            raise ValueError(f"ggml_type: expected one of {GGUF_TYPES}, got {ggml_type!r}")
        name = name.upper()
        bits, zero_point, block_bytes = _GGUF[name]
        n, k = _shape(shape)
        if k % GGUF_BLOCK:
            raise ValueError(f"shape: expected K a multiple of the GGUF block ({GGUF_BLOCK}), "
                             f"got {tuple(shape)}")
        raw = _host(data, "data")
        if raw.dtype != np.uint8:
            raise TypeError(f"data: expected dtype uint8 (raw GGUF blocks), got {raw.dtype}")
        blocks_per_row = k // GGUF_BLOCK
        if raw.size != n * blocks_per_row * block_bytes:
            raise ValueError(f"data: expected {n * blocks_per_row * block_bytes} bytes ({n} rows "
                             f"of {blocks_per_row} {name} blocks of {block_bytes} bytes) for "
                             f"shape {(n, k)}, got {raw.size} (shape {raw.shape})")
        blocks = np.ascontiguousarray(raw).reshape(n, blocks_per_row, block_bytes)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                   # (N, blocks)
        mins = None
        if bits == 4:
            body = blocks[..., 4:] if zero_point is None else blocks[..., 2:]
            if zero_point is None:
                mins = blocks[..., 2:4].copy().view(np.float16)[..., 0]
            # byte j of a block: value j in the low nibble, value j + 16 in the high one
            q = np.concatenate([body & np.uint8(0x0F), body >> np.uint8(4)], axis=-1)
        else:
            q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        q = q.reshape(n, k)
        place = lambda a: None if a is None else _place(np.ascontiguousarray(a.T), kind, device)
        return cls(name, (n, k), GGUF_BLOCK, bits, place(d),
                   _place(pack_codes(q, bits), kind, device), zero_point, None, place(mins),
                   "float16")

    @classmethod
    def from_gptq(cls, qweight: Any, scales: Any, qzeros: Any, g_idx: Any = None,
                  group_size: int = 128, *, kind: str | None = None,
                  device: Any = None) -> "QuantizedWeight":
        """A GPTQ checkpoint's 4-bit tensors (the packing AutoGPTQ / transformers write, "v1"
        zero points: the stored zero point is one less than the one used).

        qweight: int32 (K / 8, N), 8 codes along K a word (code i at bits 4i). scales: (K / G, N)
        fp16 / bf16 / fp32. qzeros: int32 (K / G, N / 8), 8 zero points along N a word. g_idx:
        None or (K,) ints, the group of each k: ``k // group_size``, or any assignment with
        ``group_size`` members a group (act-order checkpoints): then K is sorted by group at
        load (``k_perm``) and ``quant_gemm`` gathers x's columns to match, one small extra
        launch a call. kind / device: where the packed copy goes (default: torch for torch
        inputs, else numba)."""
        kind, device, qw, sc, qz = _packed_4bit_inputs(qweight, scales, qzeros, kind, device)
        k8, n = qw.shape
        k = 8 * k8
        group = _group_size(group_size, k)
        groups = k // group
        _check_group_shapes(sc, qz, groups, n)
        q = _unpack_nibbles(qw.T, _IN_ORDER)                   # (N, K): codes along K a word
        z = _unpack_nibbles(qz, _IN_ORDER) + 1  # "v1": stored zero points are one less
        if np.any(z > 15):
            raise ValueError("qzeros: a stored zero point of 15 (16 after GPTQ's +1) does not "
                             "fit 4 bits; is this a 'v2' checkpoint?")
        perm = None if g_idx is None else _act_order(_host(g_idx, "g_idx"), k, group, groups)
        if perm is not None:
            q = q[:, perm]
        return cls("gptq", (n, k), group, 4, _place(sc, kind, device),
                   _place(pack_codes(q, 4), kind, device), None, _place(z, kind, device),
                   None, sc.dtype.name,
                   None if perm is None else _place(perm.astype(np.int32), kind, device))

    @classmethod
    def from_awq(cls, qweight: Any, qzeros: Any, scales: Any, group_size: int = 128, *,
                 kind: str | None = None, device: Any = None) -> "QuantizedWeight":
        """An AWQ checkpoint's 4-bit tensors (AutoAWQ's "GEMM" packing, as transformers loads
        it): ``w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.

        qweight: int32 (K, N / 8) and qzeros: int32 (K / G, N / 8), 8 values along N a word,
        value ``AWQ_ORDER[i]`` of a group of 8 columns at bits 4i (AWQ_ORDER = 0, 2, 4, 6, 1, 3,
        5, 7). scales: (K / G, N) fp16 / bf16 / fp32. kind / device: where the packed copy goes
        (default: torch for torch inputs, else numba)."""
        kind, device, qw, sc, qz = _packed_4bit_inputs(qweight, scales, qzeros, kind, device)
        k, n8 = qw.shape
        n = 8 * n8
        group = _group_size(group_size, k)
        _check_group_shapes(sc, qz, k // group, n)
        q = _unpack_nibbles(qw, _AWQ_ORDER).T                  # (N, K)
        z = _unpack_nibbles(qz, _AWQ_ORDER)
        return cls("awq", (n, k), group, 4, _place(sc, kind, device),
                   _place(pack_codes(q, 4), kind, device), None, _place(z, kind, device),
                   None, sc.dtype.name)


#: Where the nibble at bits 4i of a packed word goes among its 8 values: in order (GPTQ), or
#: AutoAWQ's interleave (value AWQ_ORDER[i] at bits 4i).
_IN_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_nibbles(words, order):
    """(R, C) int32 words of 8 4-bit values -> (R, 8 C) uint8, nibble i of word c at column
    ``8 c + order[i]``."""
    w = np.ascontiguousarray(words).view(np.uint32)
    out = np.empty((w.shape[0], w.shape[1], 8), np.uint8)
    for i, j in enumerate(order):
        out[:, :, j] = (w >> np.uint32(4 * i)) & np.uint32(15)
    return out.reshape(w.shape[0], -1)


def _act_order(g_idx, k, group, groups):
    """The permutation that sorts K by GPTQ's ``g_idx`` (stable), or None when g_idx is the
    plain ``k // group``; ValueError unless every group has ``group`` members."""
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx: expected shape {(k,)}, got {g_idx.shape}")
    if not np.issubdtype(g_idx.dtype, np.integer):
        raise TypeError(f"g_idx: expected an integer dtype, got {g_idx.dtype}")
    if np.array_equal(g_idx, np.arange(k) // group):
        return None
    counts = np.bincount(g_idx.astype(np.int64), minlength=groups) if g_idx.min() >= 0 else None
    if counts is None or counts.size != groups or np.any(counts != group):
        raise ValueError(f"g_idx: expected each of the {groups} groups (0 .. {groups - 1}) "
                         f"{group} times, got counts {None if counts is None else counts[:8]}")
    return np.argsort(g_idx, kind="stable")


def _packed_4bit_inputs(qweight, scales, qzeros, kind, device):
    """(kind, device, qweight, scales, qzeros on the host) of a GPTQ / AWQ checkpoint's tensors,
    dtypes and ranks checked."""
    kind = kind or _kind_of(qweight)
    _check_kind(kind)
    device = device or _device_of(qweight)
    qw = _host(qweight, "qweight")
    sc = _host(scales, "scales")
    qz = _host(qzeros, "qzeros")
    for name, a in (("qweight", qw), ("qzeros", qz)):
        if a.dtype not in (np.int32, np.uint32):
            raise TypeError(f"{name}: expected dtype int32, got {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name}: expected 2 dimensions, got shape {a.shape}")
    if sc.dtype.name not in WEIGHT_DTYPES:
        raise TypeError(f"scales: expected dtype in {WEIGHT_DTYPES}, got {sc.dtype}")
    return kind, device, qw, sc, qz


def _check_group_shapes(scales, qzeros, groups, n):
    if scales.shape != (groups, n):
        raise ValueError(f"scales: expected shape {(groups, n)} (K / group_size, N), got "
                         f"{scales.shape}")
    if n % 8 or qzeros.shape != (groups, n // 8):
        raise ValueError(f"qzeros: expected shape {(groups, n // 8)} (K / group_size, N / 8), "
                         f"got {qzeros.shape}")


def _shape(shape):
    try:
        n, k = (int(v) for v in shape)
    except (TypeError, ValueError):
        raise TypeError(f"shape: expected (N, K), got {shape!r}") from None
    if n < 1 or k < 1:
        raise ValueError(f"shape: expected N, K >= 1, got {(n, k)}")
    return n, k


def _group_size(group_size, k):
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {GROUP_SIZES}, got {group_size}")
    if group_size == -1:
        return k
    if k % group_size:
        raise ValueError(f"group_size: expected K (w's shape[1], {k}) to be a multiple of the "
                         f"group size, got group_size={group_size}")
    return int(group_size)


def _quantize_torch(w, group, bits, zero_point, symmetric, dtype, name, kind, device):
    """``_quantize`` with torch ops where the tensor ``w`` lives, bit for bit the same (float32
    division and round-half-to-even, the scale rounded to ``dtype`` to nearest even)."""
    import torch

    n, k = w.shape
    qmax = (1 << bits) - 1
    g = w.to(torch.float32).reshape(n, k // group, group)
    if symmetric:
        amax = g.abs().amax(dim=-1)
        # a tensor divisor: torch divides by a Python number as a multiply by its reciprocal on
        # CUDA, one ulp off NumPy's division
        s = (amax / torch.full_like(amax, zero_point - 1)).to(w.dtype)
        s32 = s.to(torch.float32)
        safe = torch.where(s32 == 0, torch.ones_like(s32), s32)
        q = torch.clamp(torch.round(g / safe[..., None]) + zero_point, 0, qmax)
        z = None
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        s = ((hi - lo) / torch.full_like(hi, qmax)).to(w.dtype)
        s32 = s.to(torch.float32)
        safe = torch.where(s32 == 0, torch.ones_like(s32), s32)
        z = torch.clamp(torch.round(-lo / safe), 0, qmax)
        q = torch.clamp(torch.round(g / safe[..., None]) + z[..., None], 0, qmax)
        z = z.to(torch.uint8)
        zero_point = None
    codes = _pack_codes_torch(q.reshape(n, k).to(torch.int64), bits)
    place = lambda t: _place_tensor(t.T.contiguous() if t.ndim == 2 else t, kind, device)
    return QuantizedWeight(name, (n, k), group, bits, place(s), place(codes), zero_point,
                           None if z is None else place(z), None, dtype)


def _pack_codes_torch(q, bits):
    """``pack_codes`` of an (N, K) int64 torch tensor of codes: the flat chunk-major words as
    int32 (the bits of the uint32 layout)."""
    import torch

    n, k = q.shape
    ck = chunk_k(bits)
    per_word = 32 // bits
    kp = -(-k // ck) * ck
    if kp != k:
        q = torch.nn.functional.pad(q, (0, kp - k))
    parts = q.reshape(n, kp // ck, 4, per_word)
    shifts = torch.arange(0, 32, bits, device=q.device, dtype=torch.int64)
    words = (parts << shifts).sum(dim=-1)                   # disjoint bits: the sum is the OR
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.transpose(0, 1).contiguous().reshape(-1)


def _place_tensor(t, kind, device):
    """A torch result of ``_quantize_torch`` where ``_place`` would put its host copy: kept as a
    torch tensor on ``device`` (default: the current CUDA device) for kind "torch" on a GPU;
    else through the host (NumPy under the simulator, CuPy or numba otherwise)."""
    if kind == "torch" and not SIMULATOR:
        return t.to(device or "cuda")
    host = to_host(t)
    if host.dtype == np.int32 and t.ndim == 1:
        host = host.view(np.uint32)                         # the packed codes
    return _place(host, kind, device)


def _round_to(x32, dtype):
    """float32 values rounded to ``dtype`` (the scale's storage)."""
    return x32.astype(numpy_dtype(dtype))


def quantize_weight(w: ArrayLike, format: str, *, group_size: int = 128,
                    symmetric: bool = True, kind: str | None = None,
                    device: Any = None) -> QuantizedWeight:
    """Quantize an (N, K) weight (torch.nn.Linear's layout) once, at load: a torch tensor with
    torch ops where it lives (on a GPU, an 8B model in seconds), anything else with NumPy on the
    host; both give the same bits.

    w: fp16 / bf16 / fp32; a NumPy array, a torch tensor (any device), a CuPy or numba array.
    format: "int4": groups of ``group_size`` along K (32, 64, 128, or -1: one group a row),
    scales in w's dtype; symmetric: ``q = round(w / s) + 8``, s = max|w| / 7; else (AWQ style)
    a zero point per group, s = (max - min) / 15, z = round(-min / s). "int8": one scale a row
    (``group_size`` ignored), s = max|w| / 127. Every value is within s / 2 of w, plus what
    rounding s to w's dtype moves the clamp (a few units of that dtype's epsilon times s).
    "fp8_e4m3": one fp32 scale a row, s = max|w| / 448, codes e4m3(w / s) (round to nearest
    even, saturating), stored (N, K) uint8, one byte a code; K a multiple of 16. Every value is
    within half an e4m3 step (2^-4 relative, 2^-10 s near zero) of w. ``quant_gemm`` then
    quantizes x per token the same way (W8A8, Hopper only: ``_fp8_gemm``).
    kind / device: where the packed copy goes ("numba", "torch" on ``device``, "cupy";
    default: w's kind and device).

    Raises TypeError for a non-array or an unsupported dtype, ValueError for an unknown format,
    a rank other than 2, a group size not listed, or K not a multiple of the group size."""
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    if not isinstance(symmetric, (bool, np.bool_)):
        raise TypeError(f"symmetric: expected a bool, got {type(symmetric).__name__}")
    kind = kind or _kind_of(w)
    _check_kind(kind)
    device = device or _device_of(w)
    on_torch = _kind_of(w) == "torch"   # quantized where w lives, with torch (a GPU: seconds)
    host = w.detach() if on_torch else _host(w, "w")
    if host.ndim != 2:
        raise ValueError(f"w: expected 2 dimensions (N, K), got shape {tuple(host.shape)}")
    dtype = str(host.dtype).removeprefix("torch.") if on_torch else host.dtype.name
    if dtype not in WEIGHT_DTYPES:
        raise TypeError(f"w: expected dtype in {WEIGHT_DTYPES}, got {dtype}")
    n, k = host.shape
    if n == 0 or k == 0:
        raise ValueError(f"w: expected a non-empty matrix, got shape {tuple(host.shape)}")
    if format == "fp8_e4m3":
        return _quantize_fp8(host, on_torch, n, k, kind, device)
    group, bits, zero_point = (k, 8, 128) if format == "int8" else (_group_size(group_size, k),
                                                                   4, 8)
    symmetric = format == "int8" or bool(symmetric)
    if on_torch:
        return _quantize_torch(host, group, bits, zero_point, symmetric, dtype, format, kind,
                               device)
    return _quantize(host.astype(np.float32), group, bits, zero_point, symmetric, dtype, format,
                     kind, device)


def _quantize_fp8(w, on_torch, n, k, kind, device):
    """The fp8_e4m3 format (``_fp8_quant``): codes (N, K) uint8 and scales (1, N) fp32."""
    from . import _fp8_quant

    _fp8_quant.check_k(k, "w")
    if on_torch:
        codes, s = _fp8_quant.quantize_weight_torch(w)
        codes, s = _place_tensor(codes, kind, device), _place_tensor(s, kind, device)
    else:
        codes, s = _fp8_quant.quantize_weight_host(w.astype(np.float32))
        codes, s = _place(codes, kind, device), _place(s, kind, device)
    return QuantizedWeight("fp8_e4m3", (n, k), k, 8, s, codes, None, None, None, "float32")


def _quantize(w32, group, bits, zero_point, symmetric, dtype, name, kind, device):
    n, k = w32.shape
    qmax = (1 << bits) - 1
    g = w32.reshape(n, k // group, group)
    if symmetric:
        amax = np.abs(g).max(axis=-1)
        s = _round_to(amax / np.float32(zero_point - 1), dtype)     # 7 (int4) or 127 (int8)
        s32 = s.astype(np.float32)
        safe = np.where(s32 == 0, np.float32(1), s32)
        q = np.clip(np.rint(g / safe[..., None]) + zero_point, 0, qmax)
        z = None
    else:
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        s = _round_to((hi - lo) / np.float32(qmax), dtype)
        s32 = s.astype(np.float32)
        safe = np.where(s32 == 0, np.float32(1), s32)
        z = np.clip(np.rint(-lo / safe), 0, qmax).astype(np.uint8)
        q = np.clip(np.rint(g / safe[..., None]) + z[..., None], 0, qmax)
        zero_point = None
    q = q.reshape(n, k).astype(np.uint8)
    return QuantizedWeight(
        name, (n, k), group, bits, _place(s.T, kind, device),
        _place(pack_codes(q, bits), kind, device), zero_point,
        None if z is None else _place(z.T, kind, device), None, dtype)
