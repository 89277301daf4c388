"""How paged decode attention runs given shapes: the kernel configuration and the split count.

Configuration: ``CONFIGS`` (warps, stages) by head dimension, or ``BATCH_CONFIGS`` (two smaller
blocks an SM) when batch x kv heads x row tiles fill every SM without splitting, or
``SHORT_JOB_CONFIGS`` (2-warp blocks, half the waves) for 3-8 waves of those of up to 512 keys.

Split count (``num_splits=None``): from batch, kv heads, row tiles and the longest possible
sequence (``max_blocks_per_seq * block_size``: no device-to-host read), the count with the lowest
modelled time, waves of resident blocks (SMs x blocks an SM holds) x keys a split, plus fixed
costs (``choose_num_splits``): at D 128 (one 8-warp block an SM) batch 1 x 8 KV heads at 32K keys
gets 16 splits (128 blocks, one wave), batch 32 x 8 KV heads at 8K keys none. Each sequence is
then divided evenly among the splits by its own length (tile-aligned), so shorter sequences get
shorter splits. Pass a trimmed block_table (``PagedKVCache.tables`` does) so that its width
tracks the real lengths.

The sweeps behind the tables and the model's constants are in benchmarks/NOTES.md ("Paged
decode"). The configurations the planner takes are registered with the compile check here.
"""

import functools

from .. import _recording, compile_check
from .._env import SIMULATOR
from .._launch import programmatic_launch, sm_count
from ._paged_decode_copy import L2_PREFETCH
from ._paged_decode_kernel import SIGNATURE, _decode_kernel, _decode_kernel_fn
from ._paged_decode_layout import Q_IN_SHARED_FROM, TILE, shared_bytes

#: ``(warps, stages)`` by head dimension. A stage of a warp is K + V of 16 keys, 16 x D (D + 8
#: outside SWIZZLE_DIMS) x 2 x 2 B (8 KB at D 128); 8 warps x 2 stages is 128 KB a block at
#: D 128 and, at 172-224 registers a thread, one block (8 warps, 16 tiles in flight) per SM: the
#: same warps per SM as 2 blocks of 4 but half the blocks' prologues and merges, the faster of
#: the two on the H200 where the blocks do not fill the GPU unsplit. D 256 takes 2 warps (107 KB
#: with its Q tile) to keep 2 blocks, and 2 x 2 x 2 tiles in flight, per SM.
CONFIGS = {16: (4, 3), 32: (4, 3), 64: (4, 3), 128: (8, 2), 256: (2, 3)}
#: ``(warps, stages)`` by head dimension when batch x KV heads x row tiles fill every SM without
#: splitting: two 4-warp blocks an SM instead of one of 8 (the same warps, a wave of 264 blocks
#: instead of two of 132), faster there on the H200; split work keeps the 8-warp block.
BATCH_CONFIGS = {128: (4, 2)}
#: ``(warps, stages)`` by head dimension for many short jobs: when ``BATCH_CONFIGS``' blocks of
#: at most ``SHORT_JOB_MAX_KEYS`` keys would run in ``SHORT_JOB_WAVES`` (min, max) waves, 2-warp
#: blocks, twice as many resident, run them in half the waves, each wave's chain of prologue and
#: end merge paid half as often. The bounds lie between the measured points where the 2-warp
#: blocks were faster (about 4 waves of 512 keys) and slower (one wave, 15.5 waves, 4096 keys).
SHORT_JOB_CONFIGS = {128: (2, 3)}
SHORT_JOB_MAX_KEYS = 512
SHORT_JOB_WAVES = (3, 8)

#: Simulator configuration: two warps (so the cross-warp merge runs) and two stages.
SIMULATOR_CONFIG = (2, 2)

#: Split-count heuristic: a split shorter than this many tiles per warp is not worth its share of
#: the merge; at most this many splits (the merges loop over them).
MIN_TILES_PER_WARP = 2
MAX_SPLITS = 128
#: Fixed cost of a block (Q load, merge, partial write), in keys. The split merge costs the
#: last block a fixed part (the partial writes' fence, the ticket atomic, a round of L2 loads:
#: some 200-300 keys of a block's stream) and a part per split (its partials, 2 KB a split at
#: group 4, read by one SM). Fitted to a sweep of 1-16 splits on the H200 (``probe_decode.py``):
#: a smaller merge cost split 512-key sequences in two, slower than whole.
BLOCK_OVERHEAD_KEYS = 128
FOLDED_MERGE_KEYS = 256
FOLDED_MERGE_KEYS_PER_SPLIT = 1

@functools.lru_cache(maxsize=None)
def resident_blocks_per_sm(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch):
    """Blocks of the decode kernel one SM holds at once (``Kernel.blocks_per_sm``: the driver's
    occupancy calculator on the device's limits; compiles the kernel: the variant launched, so
    no other is built only to be asked)."""
    kernel = _decode_kernel(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch,
                            trigger=programmatic_launch())
    return max(1, kernel.blocks_per_sm(32 * warps, shared_bytes(head_dim, warps, stages, q_smem)))


@functools.lru_cache(maxsize=4096)
def choose_num_splits(blocks, max_len, warps, slots):
    """Split count for ``blocks`` (batch x kv heads x row tiles) blocks of at most ``max_len``
    keys on ``slots`` resident blocks (SMs x blocks per SM).

    Models the time as waves x (keys a split + a block's fixed cost), plus the merge (in the
    last block) when splitting, and takes the cheapest count (the smallest among equals); a
    split keeps at least ``MIN_TILES_PER_WARP`` tiles per warp."""
    tiles = -(-max(max_len, 1) // TILE)
    limit = max(1, min(MAX_SPLITS, tiles // (MIN_TILES_PER_WARP * warps)))
    best, best_cost = 1, None
    for splits in range(1, limit + 1):
        waves = -(-blocks * splits // slots)
        keys = -(-tiles // splits) * TILE
        cost = waves * (keys + BLOCK_OVERHEAD_KEYS)
        if splits > 1:
            cost += FOLDED_MERGE_KEYS + FOLDED_MERGE_KEYS_PER_SPLIT * splits
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best



def short_jobs_take_small_blocks(blocks, max_len, slots):
    """Whether ``blocks`` unsplit jobs of at most ``max_len`` keys, on ``slots`` resident blocks
    of the ``BATCH_CONFIGS`` configuration, run in ``SHORT_JOB_CONFIGS`` blocks instead."""
    low, high = SHORT_JOB_WAVES
    return max_len <= SHORT_JOB_MAX_KEYS and low * slots <= blocks <= high * slots


@functools.lru_cache(maxsize=4096)
def launch_plan(batch, q_len, nheads, nheads_k, headdim, block_size, max_blocks_per_seq,
                dtype, num_splits=None, tuning=None):
    """How ``paged_decode_attention`` runs these shapes: the kernel configuration
    ``(headdim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch)``, the split count,
    the query rows a KV head has (``group * q_len``) and their row tiles, and the blocks a split.
    ``tuning``: ``(warps, stages, q_smem[, l2_prefetch])`` forced (``TUNING.tuning``)."""
    group = nheads // nheads_k
    rows_total = group * q_len
    m16 = rows_total > 8
    row_tiles = -(-rows_total // (16 if m16 else 8))
    blocks = batch * nheads_k * row_tiles
    q_smem = headdim >= Q_IN_SHARED_FROM
    l2_prefetch = L2_PREFETCH
    max_len = max_blocks_per_seq * block_size

    def config_of(warps, stages):
        return (headdim, m16, block_size == 8, dtype == "bfloat16", warps, stages, q_smem,
                l2_prefetch)

    if SIMULATOR:
        warps, stages = SIMULATOR_CONFIG
    elif headdim in BATCH_CONFIGS and blocks >= sm_count():
        warps, stages = BATCH_CONFIGS[headdim]
        if headdim in SHORT_JOB_CONFIGS:
            slots = sm_count() * resident_blocks_per_sm(*config_of(warps, stages))
            if short_jobs_take_small_blocks(blocks, max_len, slots):
                warps, stages = SHORT_JOB_CONFIGS[headdim]
    else:
        warps, stages = CONFIGS[headdim]
    if tuning is not None:
        warps, stages, q_smem = tuning[:3]
        if len(tuning) > 3:
            l2_prefetch = tuning[3]
    config = config_of(warps, stages)
    if num_splits is None:
        slots = sm_count() * resident_blocks_per_sm(*config)
        num_splits = choose_num_splits(blocks, max_len, warps, slots)
    return {"config": config, "num_splits": int(num_splits), "group": group,
            "rows_total": rows_total, "row_tiles": row_tiles, "blocks": blocks}


# forgotten with every op's recorded plans: the plans read the SM count, which ``_overrides``
# may change
_recording.on_clear(launch_plan.cache_clear)


# ---- compile-only check -------------------------------------------------------------------

def _compile_target(*config):
    return lambda: (_decode_kernel_fn(*config), SIGNATURE)


# D 128 m8 bf16 is the benchmarked batch-1 / batch-32 decode (GQA 4 and MHA alike); "batch":
# the configuration taken when the blocks fill the GPU unsplit, "short": many short jobs
_TABLES = {"": CONFIGS, "batch": BATCH_CONFIGS, "short": SHORT_JOB_CONFIGS}
for _dim, _m16, _page8, _bf16, _table in ((128, False, False, True, ""),
                                          (128, False, False, True, "batch"),
                                          (128, False, False, True, "short"),
                                          (128, True, False, True, ""),
                                          (128, False, True, False, ""),
                                          (64, False, False, True, ""),
                                          (256, False, False, False, ""),
                                          (256, True, False, True, "")):
    _warps, _stages = _TABLES[_table][_dim]
    compile_check.register(
        f"paged_decode_d{_dim}_{'m16' if _m16 else 'm8'}{'_page8' if _page8 else ''}_"
        f"{'bf16' if _bf16 else 'f16'}{'_' + _table if _table else ''}",
        _compile_target(_dim, _m16, _page8, _bf16, _warps, _stages,
                        _dim >= Q_IN_SHARED_FROM, L2_PREFETCH),
        ptx_must_have=("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4.shared",
                       "ldmatrix.sync.aligned.m8n8.x4.trans",
                       f"cp.async.cg.shared.global.L2::{L2_PREFETCH}B" if L2_PREFETCH
                       else "cp.async.cg.shared.global"),
        sass_must_have=("HMMA", "LDSM", "LDGSTS"))
