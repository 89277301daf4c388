"""GEMM tile configurations: ``GemmConfig``, the named catalogue ``CONFIGS``, and how a
configuration is chosen when the caller gives none (``heuristic``, the autotuner's
``candidates``, the K split ``split_count``). Why each default is what it is, with the
measurements: benchmarks/NOTES.md ("GEMM tile defaults").
"""

import dataclasses
import functools

from .._checks import choice
from .._env import SIMULATOR, cuda
from .._launch import max_shared_per_block_optin, sm_count
from . import _gemm_simt, _gemm_tensor_core, _gemm_wgmma


def _cdiv(x, y):
    return -(-x // y)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tile configuration.

    Tensor Core: a ``block_m x block_n`` block tile stepping K by ``block_k``, ``warps_m x warps_n``
    warps (each a ``block_m / warps_m x block_n / warps_n`` warp tile), ``stages`` cp.async
    stages. SIMT: ``thread_m x thread_n`` accumulators per thread, two buffers. Both: ``split_k``
    K splits (None: chosen by shape), rasterisation in groups of ``group_m`` block rows, and
    ``min_blocks``: launch bounds asking ptxas to fit that many blocks per SM (registers capped
    at 65536 / (threads * min_blocks); 0: no bound; None: ``_min_blocks``' default; name suffix
    ``_b<min_blocks>`` when set). ``wgmma``: the Hopper kernel (``_gemm_wgmma``, sm_90 only):
    ``block_m / 64`` warpgroups, ``block_k`` 64, warp fields unused; it needs both operands
    16-byte aligned and otherwise runs as the ``mma.sync`` kernel of ``LARGE_CONFIG``;
    ``producer``: its warp-specialised form (a copying warpgroup besides, mbarrier hand-over;
    name suffix ``_p``); ``tma``: the producer's copies made by the Tensor Memory Accelerator,
    one box a tile an operand (name suffix ``_tma``; both operands K-major, else the kernel
    runs as the ``tma=False`` twin).
    ``gemv``: the few-row CUDA-core kernel (``_gemv``, fp16 / bf16) for M <= ``block_m``:
    ``block_n`` output columns a block of ``warps_n`` warps, ``stages`` chunk steps a loop
    iteration; it needs both operands K-major and 16-byte aligned and K a multiple of 8, and
    otherwise runs as the heuristic's Tensor Core tile.
    """
    backend: str = "tensor_core"
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 4
    thread_m: int = 8
    thread_n: int = 8
    split_k: int | None = None
    group_m: int = 8
    min_blocks: int | None = None
    wgmma: bool = False
    gemv: bool = False
    producer: bool = False
    tma: bool = False

    @property
    def name(self):
        tile = f"{self.block_m}x{self.block_n}x{self.block_k}"
        if self.gemv:
            body = f"gemv_{self.block_m}x{self.block_n}_w{self.warps_n}_u{self.stages}"
        elif self.wgmma:
            body = f"wg_{tile}_s{self.stages}" + ("_p" if self.producer else "") + (
                "_tma" if self.tma else "")
        elif self.backend == "tensor_core":
            body = f"tc_{tile}_w{self.warps_m}x{self.warps_n}_s{self.stages}"
        else:
            body = f"simt_{tile}_t{self.thread_m}x{self.thread_n}"
        if self.min_blocks is not None:
            body += f"_b{self.min_blocks}"
        if self.group_m != 8:
            body += f"_g{self.group_m}"
        return body + ("" if self.split_k is None else f"_k{self.split_k}")

    @property
    def threads(self):
        if self.gemv:
            return 32 * self.warps_n
        if self.wgmma:
            return _gemm_wgmma.threads_for(self.block_m, self.producer)
        if self.backend == "tensor_core":
            return 32 * self.warps_m * self.warps_n
        return _gemm_simt.threads(self.block_m, self.block_n, self.thread_m, self.thread_n)

    def shared_bytes(self):
        if self.gemv:
            return 0  # static shared memory only
        if self.wgmma:
            return _gemm_wgmma.shared_bytes(self.block_m, self.block_n, self.stages)
        if self.backend == "tensor_core":
            return _gemm_tensor_core.shared_bytes(self.block_m, self.block_n, self.block_k,
                                                  self.stages)
        return 0  # static shared memory only

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def check(self):
        """``ValueError`` naming ``config`` when this configuration cannot run."""
        def bad(why):
            raise ValueError(f"config: {self.name}: {why}")

        def pow2(x):
            return x >= 1 and x & (x - 1) == 0

        choice("config.backend", self.backend, ("tensor_core", "simt"))
        if self.split_k is not None and (not isinstance(self.split_k, int) or self.split_k < 1):
            bad(f"split_k must be None or an int >= 1, got {self.split_k!r}")
        if self.group_m < 1:
            bad("group_m must be >= 1")
        if self.min_blocks is not None and (not isinstance(self.min_blocks, int) or
                                            not 0 <= self.min_blocks <= 32):
            bad(f"min_blocks must be None or an int in [0, 32], got {self.min_blocks!r}")
        if self.producer and not self.wgmma:
            bad("producer (warp specialisation) is a form of the wgmma kernel only")
        if self.tma and not self.producer:
            bad("tma (copies by the Tensor Memory Accelerator) is a form of the producer kernel "
                "only")
        if self.gemv:
            if self.backend != "tensor_core" or self.wgmma or self.block_m not in (1, 2, 4) or \
                    not 1 <= self.block_n <= 16 or self.warps_n not in (1, 2, 4, 8, 16) or \
                    not 1 <= self.stages <= 4 or self.block_k != 8 or self.split_k not in (None, 1):
                bad("gemv needs backend 'tensor_core', block_m 1, 2 or 4, block_n 1-16, "
                    "warps_n 1-16 (a power of 2), stages 1-4, block_k 8 and no K split")
        elif self.wgmma:
            if self.backend != "tensor_core" or self.block_m not in (64, 128) or \
                    self.block_n not in (64, 128, 256) or self.block_k != 64 or self.stages < 3:
                bad("wgmma needs backend 'tensor_core', block_m 64 or 128, block_n 64, 128 or "
                    "256, block_k 64 and stages >= 3")
            if not wgmma_supported():
                bad("wgmma needs an sm_90 GPU (Hopper)")
        elif self.backend == "tensor_core":
            if not all(pow2(x) for x in (self.block_m, self.block_n, self.block_k,
                                         self.warps_m, self.warps_n)):
                bad("block sizes and warp counts must be powers of 2")
            if not 16 <= self.block_k <= 64 or self.block_m < 16 * self.warps_m or \
                    self.block_n < 16 * self.warps_n:
                bad("needs 16 <= block_k <= 64 and warp tiles of at least 16 x 16")
            if max(self.block_m, self.block_n, self.block_k) // 8 > self.threads:
                bad("a tile row has more 16-byte chunks than the block has threads")
            if self.stages < 2:
                bad("needs stages >= 2")
        else:
            if self.block_m % self.thread_m or self.block_n % self.thread_n:
                bad("block_m / block_n must be multiples of thread_m / thread_n")
            t = self.threads
            if t > 1024 or (self.block_m * self.block_k) % t or (self.block_n * self.block_k) % t:
                bad(f"{t} threads must divide both tiles' elements (and be <= 1024)")
            if 8 * self.block_k * (self.block_m + self.block_n + 8) > 48 * 1024:
                bad("needs more than 48 KB of static shared memory")
        if self.backend == "tensor_core":   # dynamic shared memory, opted in beyond 48 KB
            limit = max_shared_per_block_optin()
            if self.shared_bytes() > limit:
                bad(f"needs {self.shared_bytes()} bytes of shared memory, the device allows "
                    f"{limit}")
        return self


#: Named configurations (``config="tc_128x128x32_w2x2_s4"``); the autotuner's candidates.
CONFIGS = {c.name: c for c in (
    # large tiles: 64 x 64 warp tiles, 2 blocks per SM (128x128) or one of 8 warps (128x256)
    GemmConfig("tensor_core", 128, 128, 32, 2, 2, 4),
    GemmConfig("tensor_core", 128, 128, 64, 2, 2, 3),
    GemmConfig("tensor_core", 128, 256, 32, 2, 4, 3),
    GemmConfig("tensor_core", 256, 128, 32, 4, 2, 3),
    GemmConfig("tensor_core", 128, 256, 64, 2, 4, 3),
    GemmConfig("tensor_core", 256, 128, 64, 4, 2, 3),
    # medium: 64 x 32 warp tiles
    GemmConfig("tensor_core", 64, 128, 64, 1, 4, 4),
    GemmConfig("tensor_core", 64, 64, 64, 2, 2, 4),
    # decode (M <= 32): one or two 16-row fragments per warp; memory-bound on B
    GemmConfig("tensor_core", 16, 128, 64, 1, 4, 4),
    GemmConfig("tensor_core", 16, 256, 64, 1, 8, 4),
    GemmConfig("tensor_core", 32, 128, 64, 1, 4, 4),
    # Hopper (sm_90): two warpgroups of m64n256 (128 fp32 accumulators a thread) or m64n128
    GemmConfig("tensor_core", 128, 256, 64, stages=4, wgmma=True),
    GemmConfig("tensor_core", 128, 128, 64, stages=5, wgmma=True),
    # decode on CUDA cores (M <= 1, 2, 4): the weight streamed, 4 columns a block of 4 warps
    GemmConfig("tensor_core", 1, 4, 8, 1, 4, 2, gemv=True),
    GemmConfig("tensor_core", 2, 4, 8, 1, 4, 2, gemv=True),
    GemmConfig("tensor_core", 4, 4, 8, 1, 4, 2, gemv=True),
    # Hopper, few rows (batched decode, M = 17-256): one warpgroup of 64 rows
    GemmConfig("tensor_core", 64, 128, 64, stages=4, wgmma=True),
    GemmConfig("tensor_core", 64, 128, 64, stages=6, wgmma=True),
    GemmConfig("tensor_core", 64, 256, 64, stages=3, wgmma=True),
    GemmConfig("tensor_core", 64, 256, 64, stages=4, wgmma=True),
    # Hopper, few rows, narrow: twice the blocks of 128 columns at N = 4096 (64 x 64 tiles fit
    # two blocks an SM at six stages)
    GemmConfig("tensor_core", 64, 64, 64, stages=6, wgmma=True),
    GemmConfig("tensor_core", 64, 64, 64, stages=8, wgmma=True),
    GemmConfig("tensor_core", 128, 64, 64, stages=6, wgmma=True),
    GemmConfig("tensor_core", 128, 64, 64, stages=8, wgmma=True),
    GemmConfig("tensor_core", 64, 128, 64, stages=8, wgmma=True),
    # the same, warp-specialised (a producer warpgroup copies, mbarriers hand stages over)
    GemmConfig("tensor_core", 64, 128, 64, stages=6, wgmma=True, producer=True),
    GemmConfig("tensor_core", 64, 128, 64, stages=8, wgmma=True, producer=True),
    GemmConfig("tensor_core", 64, 256, 64, stages=4, wgmma=True, producer=True),
    GemmConfig("tensor_core", 64, 64, 64, stages=8, wgmma=True, producer=True),
    GemmConfig("tensor_core", 128, 64, 64, stages=6, wgmma=True, producer=True),
    GemmConfig("tensor_core", 128, 128, 64, stages=5, wgmma=True, producer=True),
    # the same, copies by the Tensor Memory Accelerator (opt-in; timed in benchmarks/NOTES.md,
    # session 24)
    GemmConfig("tensor_core", 64, 64, 64, stages=8, wgmma=True, producer=True, tma=True),
    GemmConfig("tensor_core", 64, 128, 64, stages=8, wgmma=True, producer=True, tma=True),
    GemmConfig("tensor_core", 64, 256, 64, stages=4, wgmma=True, producer=True, tma=True),
    GemmConfig("tensor_core", 128, 128, 64, stages=5, wgmma=True, producer=True, tma=True),
    # SIMT: 8 x 8 per thread, 256 threads, two blocks per SM (128 registers); BK = 16 halves
    # the barriers per FMA
    GemmConfig("simt", 128, 128, 8, thread_m=8, thread_n=8),
    GemmConfig("simt", 128, 128, 16, thread_m=8, thread_n=8),
    GemmConfig("simt", 64, 64, 8, thread_m=4, thread_n=4),
    # simulator: same kernels, tiles small enough for a few emulated warps
    GemmConfig("tensor_core", 16, 16, 16, 1, 1, 2),
    GemmConfig("tensor_core", 32, 32, 16, 2, 1, 3),
    GemmConfig("tensor_core", 16, 16, 32, 1, 1, 2),   # two k16 steps per K tile
    GemmConfig("tensor_core", 64, 64, 64, stages=3, wgmma=True),
    GemmConfig("tensor_core", 64, 64, 64, stages=3, wgmma=True, producer=True),
    GemmConfig("tensor_core", 64, 64, 64, stages=3, wgmma=True, producer=True, tma=True),
    GemmConfig("simt", 16, 16, 8, thread_m=2, thread_n=2),
)}

#: The heuristic's block tile for problems with about a wave of its tiles or more: the one
#: constant to switch when ``bench_gemm.py --only-sweep`` finds a faster one (the fastest
#: mma.sync tile of the sweep at 4096^3 / 8192^3, fp16 and bf16).
LARGE_CONFIG = "tc_128x256x64_w2x4_s3"
#: Hopper's tiles above ``SMALL_M_WGMMA_MAX`` rows and the cost of one wave of each (one block
#: an SM, all blocks of a wave in step): us per 1024 of K, on top of ``WGMMA_WAVE_FIXED_US``
#: (the same for all three), fitted to every tile at 384-1024 rows and N x K of 1024^2-14336 x
#: 4096 on the H200 (benchmarks/NOTES.md, session 29). ``_wave_wgmma`` takes the tile of least
#: ``waves * (fixed + per_k * K / 1024)``: the largest tile is the most efficient a wave, a
#: smaller one wins where it saves a wave. The 64 x 128 tile copies by TMA (5-13% faster than
#: its cp.async form where it was picked, session 31; its cost is the cp.async form's, so the
#: picks stay those fitted); calls no tensor map serves run its cp.async form.
WGMMA_WAVE_COSTS = {"wg_128x256x64_s4": 10.6, "wg_128x128x64_s5": 6.0,
                    "wg_64x128x64_s8_p_tma": 3.33}
WGMMA_WAVE_FIXED_US = 7.3
#: The autotuner's candidates for M > 32, most promising first (256x128x64 is the transpose
#: of 128x256x64).
LARGE_CANDIDATES = ("tc_128x128x64_w2x2_s3", "tc_128x256x64_w2x4_s3", "tc_256x128x64_w4x2_s3",
                    "tc_128x128x32_w2x2_s4", "tc_64x128x64_w1x4_s4")
#: The heuristic's SIMT block tile above 512 x 512 outputs (switch like ``LARGE_CONFIG``; BK = 16
#: halves the barriers per FMA and was the faster fp32 tile at 4096^3).
SIMT_CONFIG = "simt_128x128x16_t8x8"
#: SIMT candidates (fp32) of the autotuner and the sweep.
SIMT_CANDIDATES = ("simt_128x128x8_t8x8", "simt_128x128x16_t8x8", "simt_64x64x8_t4x4")
#: Candidates for M <= 32 (decode): one or two 16-row fragments per warp.
SMALL_M_CANDIDATES = ("tc_16x128x64_w1x4_s4", "tc_16x256x64_w1x8_s4", "tc_32x128x64_w1x4_s4")

#: The most rows the heuristic gives the CUDA-core few-row kernel (``gemv_*``): at M = 4 its
#: 4-row form was slower than the decode Tensor Core tile (benchmarks/NOTES.md, "Few-row GEMM on
#: CUDA cores"); M = 2 is not measured yet.
GEMV_MAX_M = 1
#: Few rows (17 .. ``SMALL_M_WGMMA_MAX``) on Hopper: ``_few_rows_wgmma`` picks the tile.
SMALL_M_WGMMA_MAX = 256
#: The least K a split of a wgmma tile takes (``split_count``).
SPLIT_MIN_K_WGMMA = 3072
SMALL_M_WGMMA_CANDIDATES = ("wg_64x128x64_s8", "wg_64x64x64_s8", "wg_64x128x64_s6",
                            "wg_64x256x64_s4", "wg_64x256x64_s4_p", "wg_64x128x64_s8_p",
                            "wg_64x128x64_s8_p_tma")

#: The simulator's tiles (a few emulated warps).
SIM_TC = CONFIGS["tc_16x16x16_w1x1_s2"]
SIM_SIMT = CONFIGS["simt_16x16x8_t2x2"]


def wgmma_supported():
    """The Hopper kernel can run: compute capability 9.0 (numba builds sm_90a there), or the
    simulator, whose twins model the instructions."""
    return SIMULATOR or _compute_capability() == (9, 0)


@functools.cache
def _compute_capability():
    return tuple(cuda.get_current_device().compute_capability)


def resolve_config(config):
    """A ``GemmConfig`` from a ``GemmConfig``, a name in ``CONFIGS`` or a dict of fields."""
    if isinstance(config, GemmConfig):
        return config.check()
    if isinstance(config, str):
        base, _, split = config.partition("_k")
        if config in CONFIGS:
            return CONFIGS[config]
        if base in CONFIGS and split.isdigit():
            return CONFIGS[base].replace(split_k=int(split)).check()
        raise ValueError(f"config: unknown name {config!r}; known: {sorted(CONFIGS)}")
    if isinstance(config, dict):
        try:
            return GemmConfig(**config).check()
        except TypeError as exc:
            raise ValueError(f"config: {exc}") from None
    raise TypeError(f"config: expected None, a GemmConfig, a name or a dict, got "
                    f"{type(config).__name__}")


def heuristic(backend, M, N, K, wgmma=True, gemv=True):
    """A reasonable configuration by shape, when nothing better is known. ``wgmma=False``: no
    Hopper tile (an operand not 16-byte aligned); ``gemv=False``: no CUDA-core few-row kernel
    (the operands' layout or K does not allow it)."""
    if SIMULATOR:
        return SIM_TC if backend == "tensor_core" else SIM_SIMT
    if backend == "simt":
        return CONFIGS["simt_64x64x8_t4x4" if M * N <= 512 * 512 else SIMT_CONFIG]
    if gemv and M <= GEMV_MAX_M:
        return gemv_config(M)
    if M <= 16:
        return CONFIGS["tc_16x128x64_w1x4_s4"]
    wgmma = wgmma and wgmma_supported()
    if wgmma and M <= SMALL_M_WGMMA_MAX:
        return _few_rows_wgmma(M, N, K)
    if M <= 32:
        return CONFIGS["tc_32x128x64_w1x4_s4"]
    # M <= 128: 64-row tiles, twice the blocks of 128-row ones (split-K fills the rest; faster
    # than 128x128x64 at M = 128 except with the longest K)
    if M <= 128 or N <= 64:
        return CONFIGS["tc_64x128x64_w1x4_s4"]
    # Hopper: the wgmma tile of fewest wave-costs (``_run`` swaps it for an mma.sync tile when
    # an operand is not 16-byte aligned)
    if wgmma:
        return _wave_wgmma(M, N, K)
    # the largest tile that still gives about a wave of blocks; else 128 x 128 with split-K
    for name in (LARGE_CONFIG, "tc_128x128x64_w2x2_s3", "tc_64x128x64_w1x4_s4"):
        cfg = CONFIGS[name]
        if _cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n) >= 0.75 * sm_count():
            return cfg
    return CONFIGS["tc_128x128x64_w2x2_s3"]


def gemv_config(M):
    """The registered few-row kernel for M <= 4 rows (its rows: M rounded up to 1, 2 or 4)."""
    return CONFIGS[f"gemv_{1 << (M - 1).bit_length()}x4_w4_u2"]


def gemv_fits(p, cfg):
    """The few-row kernel ``cfg`` can run problem ``p`` (``gemm._Problem``): at most its rows,
    both operands K-major with 16-byte loads, K a multiple of 8 (an even column count if
    gated)."""
    return (p.M <= cfg.block_m and p.a_k_inner and p.b_k_inner and p.a_vec and p.b_vec
            and p.K % 8 == 0 and (cfg.block_n % 2 == 0 or not p.gated))


def _few_rows_wgmma(M, N, K):
    """Hopper's tile for 16 < M <= ``SMALL_M_WGMMA_MAX`` (batched decode), from the sweeps of
    every tile and split at M 16-256 (benchmarks/NOTES.md, "GEMM for few rows" and "Narrow and
    warp-specialised few-row tiles"): 64-row tiles of eight stages (deep prefetch: one block an
    SM streams B), 64 columns wide while 128-column tiles would fill under half the GPU (twice
    the blocks streaming), 128-row ones from M = 65 when they give about a wave of tiles (or a
    long K to split), the decode tile at M <= 32 unless N is large (it reads B once per 16
    rows). The warp-specialised form where it won: 64 x 256 for 64 rows and a wave of such
    tiles, 64 x 128 beyond 128 rows (in place of 128-row tiles with split K), copying by TMA
    (10-20% faster than its cp.async form at 192-256 rows, session 31)."""
    if M <= 32:
        return CONFIGS["tc_16x128x64_w1x4_s4" if N <= 8192 else "wg_64x128x64_s8"]
    if _cdiv(M, 64) * _cdiv(N, 128) <= sm_count() // 2:
        return CONFIGS["wg_64x64x64_s8"]
    if M <= 64 and _cdiv(N, 256) >= 0.75 * sm_count():
        return CONFIGS["wg_64x256x64_s4_p"]
    if M > 64:
        for name in ("wg_128x256x64_s4", "wg_128x128x64_s5"):
            cfg = CONFIGS[name]
            if _cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n) >= 0.7 * sm_count():
                return cfg
        if M > 128:
            return CONFIGS["wg_64x128x64_s8_p_tma"]
        if K >= 2 * SPLIT_MIN_K_WGMMA:
            return CONFIGS["wg_128x128x64_s5"]
    return CONFIGS["wg_64x128x64_s8"]


def _wave_wgmma(M, N, K):
    """Hopper's tile above ``SMALL_M_WGMMA_MAX`` rows: the least cost by ``WGMMA_WAVE_COSTS``."""
    def cost(name):
        cfg = CONFIGS[name]
        waves = _cdiv(_cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n), sm_count())
        return waves * (WGMMA_WAVE_FIXED_US + WGMMA_WAVE_COSTS[name] * K / 1024)

    return CONFIGS[min(WGMMA_WAVE_COSTS, key=cost)]


def split_count(cfg, M, N, K):
    """K splits of ``cfg`` for this shape: ``cfg.split_k``, or enough blocks for two waves of
    the GPU, bounded so each split keeps at least two K tiles and the fp32 workspace traffic
    (written and read once) stays below the traffic of B. wgmma tiles (one block an SM: their
    shared memory) aim at one wave, with at least ``SPLIT_MIN_K_WGMMA`` of K a split (a split
    costs its partial tile's round trip through L2 at the end; above 256 rows, splits to fill
    two waves ran 1.2-1.6x slower than none at 12-448 tiles: benchmarks/NOTES.md, session 29;
    narrower problems, under a quarter wave of tiles, keep the two-wave rule)."""
    if cfg.gemv:
        return 1  # its warps split K inside the block
    if cfg.split_k is not None:
        return max(1, min(cfg.split_k, _cdiv(K, cfg.block_k)))
    tiles = _cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n)
    if cfg.wgmma and (M <= SMALL_M_WGMMA_MAX or tiles >= sm_count() // 4):
        return max(1, min(sm_count() // tiles, K // SPLIT_MIN_K_WGMMA, 32))
    want = (2 * sm_count()) // tiles
    cap = min(K // (2 * cfg.block_k), max(1, K // (4 * M)), 32)
    return max(1, min(want, cap))


def candidates(p):
    """Configurations the autotuner times for problem ``p`` (``gemm._Problem``: its backend, M,
    N, K and whether both operands allow 16-byte loads)."""
    if SIMULATOR:
        pool = [SIM_TC, CONFIGS["tc_32x32x16_w2x1_s3"]] if p.backend == "tensor_core" else [
            SIM_SIMT]
    elif p.backend == "simt":
        pool = [CONFIGS[n] for n in SIMT_CANDIDATES]
    elif p.M <= 32:
        pool = [CONFIGS[n] for n in SMALL_M_CANDIDATES]
        if p.M > 16:
            pool = pool[2:]
    else:
        pool = [CONFIGS[n] for n in LARGE_CANDIDATES]
        if wgmma_supported() and p.a_vec and p.b_vec:
            pool = [CONFIGS[n] for n in WGMMA_WAVE_COSTS] + pool
    if wgmma_supported() and p.a_vec and p.b_vec and 16 < p.M <= SMALL_M_WGMMA_MAX:
        pool = [CONFIGS[n] for n in SMALL_M_WGMMA_CANDIDATES] + pool
    if not SIMULATOR and p.backend == "tensor_core" and p.M <= 4 and \
            gemv_fits(p, gemv_config(p.M)):
        pool = [gemv_config(p.M)] + pool
    out = []
    for cfg in dict.fromkeys(pool):   # a tile in two of the lists is timed once
        out.append(cfg)
        if cfg.gemv:    # no K split: its warps split K inside the block
            continue
        tiles = _cdiv(p.M, cfg.block_m) * _cdiv(p.N, cfg.block_n)
        if tiles < 2 * sm_count():  # few tiles: also try fixed splits around the heuristic's
            k_tiles = _cdiv(p.K, cfg.block_k)
            for split in (1, 2, 4, 8, 16):
                if split <= max(1, k_tiles // 2):
                    out.append(cfg.replace(split_k=split))
    return out
