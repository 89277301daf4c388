"""Demo of paged-KV decode attention: a PagedKVCache filled by paged_kv_append, then one decode
step (and a speculative 3-token step), checked against the float64 reference."""

import numpy as np

from ._case import DemoCase, time_call
from ..ops.paged_decode import paged_decode_attention
from ..paged_cache import PagedKVCache
from ..reference.paged_decode import paged_decode_attention as reference
from ..testing import f64, random_array, to_device, to_host


def cases(on_gpu):
    if on_gpu:
        batch, nheads, nheads_k, headdim, block_size, length = 8, 32, 8, 128, 16, 4096
    else:
        batch, nheads, nheads_k, headdim, block_size, length = 2, 4, 2, 16, 8, 21
    kind = "torch" if on_gpu else "numba"

    def run(dtype, q_len):
        rng = np.random.default_rng(0)
        cache = PagedKVCache(num_blocks=batch * (-(-length // block_size) + 1),
                             block_size=block_size, nheads_k=nheads_k, headdim=headdim,
                             dtype=dtype, kind=kind)
        seqs = [cache.add_sequence() for _ in range(batch)]
        k = random_array((batch, length, nheads_k, headdim), dtype, rng)
        v = random_array((batch, length, nheads_k, headdim), dtype, rng)
        block_table, seq_lens = cache.append(seqs, to_device(k, kind), to_device(v, kind))
        q_host = random_array((batch, q_len, nheads, headdim), dtype, rng)
        q = to_device(q_host, kind)
        out = paged_decode_attention(q, cache.k_cache, cache.v_cache, block_table, seq_lens)
        args = (q_host, to_host(cache.k_cache), to_host(cache.v_cache), to_host(block_table),
                to_host(seq_lens))
        want, _ = reference(*args)
        plain, _ = reference(*args, dtype=dtype)
        err = float(np.abs(f64(out) - want).max())
        tol = 2 * float(np.abs(plain - want).max()) + 1e-6
        seconds = time_call(lambda: paged_decode_attention(
            q, cache.k_cache, cache.v_cache, block_table, seq_lens), on_gpu)
        return err, tol, seconds

    shape = f"B{batch} H{nheads}/{nheads_k} S{length} D{headdim} page{block_size}"
    return [DemoCase(f"paged_decode {dt} q_len {n}", shape, lambda dt=dt, n=n: run(dt, n))
            for dt, n in (("float16", 1), ("bfloat16", 1), ("bfloat16", 3))]
