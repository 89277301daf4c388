"""Autotuning: time the candidate tile configurations of an op once per shape class, and remember
the winner on disk (``_tuning_cache``).

    cfg = llmspeed_numba.autotune.autotune(a, b)        # times gemm's candidates for this shape
    llmspeed_numba.gemm(a, b)                           # now runs the winner for this shape class

``gemm(..., backend="auto")`` consults the cache on every call (a dict lookup); with
``LLMSPEED_NUMBA_AUTOTUNE=1`` in the environment a cache miss is tuned on the spot instead of
falling back to the heuristic. The cache functions (``lookup``, ``record``, ``forget``,
``cache_path``, ...) are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ._tuning_cache import (cache_dir, cache_path, enabled, forget, generation, lookup, record,
                            time_ms)
from ._typing import ArrayLike, DTypeLike, StreamLike

if TYPE_CHECKING:
    from .ops.gemm_configs import GemmConfig


def autotune(a: ArrayLike, b: ArrayLike, *, c: ArrayLike | None = None, alpha: float = 1.0,
             beta: float = 0.0, bias: ArrayLike | None = None, activation: str | None = None,
             out: ArrayLike | None = None, out_dtype: DTypeLike | None = None,
             backend: str = "auto", stream: StreamLike = None,
             candidates: Sequence[GemmConfig | str | dict] | None = None, warmup: int = 2,
             rep: int = 10) -> GemmConfig:
    """Autotune ``gemm`` for the shape class of these arguments (same meaning as ``gemm``'s);
    returns the winning ``GemmConfig``, which later ``gemm`` calls of the class then use.
    ``candidates``: the configurations to time (default: ``ops.gemm_configs.candidates``)."""
    from .ops import gemm as _gemm  # here: importing the package must not load the GEMM
    from .ops.gemm_configs import resolve_config

    p = _gemm.prepare(a, b, c, alpha, beta, bias, activation, out, out_dtype, backend, stream)
    if min(p.M, p.N, p.K) == 0:
        raise ValueError(f"autotune: nothing to tune for an empty problem "
                         f"(M, N, K) = {(p.M, p.N, p.K)}")
    if candidates is not None:
        candidates = [resolve_config(x) for x in candidates]
    return _gemm.tune(p, candidates, warmup, rep)


__all__ = ["autotune", "lookup", "record", "enabled", "cache_dir", "cache_path", "time_ms",
           "forget", "generation"]
