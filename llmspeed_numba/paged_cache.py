"""A host-side page allocator for the paged KV cache.

``PagedKVCache`` owns ``k_cache`` / ``v_cache`` (num_blocks, block_size, nheads_k, headdim) in the
array kind the caller picks (numba device arrays by default, torch or CuPy tensors on request;
host NumPy arrays under the CUDA simulator), hands pages to sequences as they grow, takes them back
when a sequence is freed, and builds the ``block_table`` / ``seq_lens`` int32 arrays that
``paged_kv_append`` and ``paged_decode_attention`` read. Running out of pages raises
``OutOfPages`` (a ``RuntimeError``) and changes nothing.

A decode step::

    cache = PagedKVCache(num_blocks=4096, block_size=16, nheads_k=8, headdim=128,
                         dtype="bfloat16", kind="torch")
    seqs = [cache.add_sequence() for _ in range(batch)]
    block_table, seq_lens = cache.append(seqs, k_new, v_new)   # (batch, n, nheads_k, headdim)
    out = paged_decode_attention(q, cache.k_cache, cache.v_cache, block_table, seq_lens)
    cache.free(seqs[0])                                          # a finished sequence

All bookkeeping is on the host (Python lists, mirrored in a NumPy table of page rows that
``host_tables`` gathers from): no device synchronisation. The tables are built on the host and
copied to the device on each ``tables`` / ``append`` call.
"""

from typing import Iterable, Sequence

import numpy as np

from ._arrays import dtype_name, numpy_dtype
from ._env import SIMULATOR, cuda, require_cuda
from ._typing import ArrayLike, DTypeLike, StreamLike

__all__ = ["NO_PAGE", "OutOfPages", "PageAllocator", "PagedKVCache"]

KINDS = ("numba", "torch", "cupy")

#: ``block_table`` entry of a slot past a sequence's last page (never read for valid lengths).
NO_PAGE = -1


class OutOfPages(RuntimeError):
    """The cache has fewer free pages than an allocation needs (nothing was allocated)."""


class PageAllocator:
    """Host bookkeeping of a paged KV cache: which pages each sequence holds, and its length.

    ``num_blocks`` pages of ``block_size`` tokens; ``max_blocks_per_seq``: an optional limit on
    one sequence's pages (``ValueError`` past it), also the minimum width of the tables. Pure
    Python (no device), so a scheduler can plan with it on any machine.
    """

    def __init__(self, num_blocks: int, block_size: int, *,
                 max_blocks_per_seq: int | None = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value}")
        if block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two, got {block_size}")
        if max_blocks_per_seq is not None:
            if isinstance(max_blocks_per_seq, bool) or not isinstance(max_blocks_per_seq,
                                                                      (int, np.integer)):
                raise TypeError(f"max_blocks_per_seq: expected an int or None, got "
                                f"{type(max_blocks_per_seq).__name__}")
            if max_blocks_per_seq < 1:
                raise ValueError(f"max_blocks_per_seq: expected a positive int or None, got "
                                 f"{max_blocks_per_seq}")
            max_blocks_per_seq = int(max_blocks_per_seq)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._pages = {}
        self._lengths = {}
        self._next_id = 0
        # The page lists again as rows of a 2-D int32 table (NO_PAGE past a sequence's pages),
        # one row ("slot") per live sequence, so that host_tables is one gather; rows and
        # columns grow by doubling, freed rows are reused.
        self._slot = {}
        self._free_slots = []
        self._rows = np.full((16, min(16, self.num_blocks)), NO_PAGE, np.int32)

    # ---- bookkeeping -----------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return list(self._lengths)

    def length(self, seq_id: int) -> int:
        return self._lengths[self._check_id(seq_id)]

    def num_pages(self, seq_id: int) -> int:
        """How many pages a sequence holds (``len(pages(seq_id))`` without the copy)."""
        return len(self._pages[self._check_id(seq_id)])

    def most_pages(self, seq_ids: Sequence[int]) -> int:
        """The most pages any of ``seq_ids`` holds (0 for none)."""
        try:
            return max(map(len, map(self._pages.__getitem__, seq_ids)), default=0)
        except KeyError:
            for i in seq_ids:
                self._check_id(i)
            raise

    def pages(self, seq_id: int) -> list[int]:
        """Page ids of a sequence, in order (a copy)."""
        return list(self._pages[self._check_id(seq_id)])

    def _check_id(self, seq_id):
        if seq_id not in self._lengths:
            raise KeyError(f"seq_id: no live sequence {seq_id!r} (freed, or never added)")
        return seq_id

    def _pages_for(self, length):
        return -(-length // self.block_size)

    @property
    def max_seq_len(self):
        """The most tokens one sequence can ever hold: the whole cache, or
        ``max_blocks_per_seq`` pages when that is smaller."""
        return min(self.num_blocks, self.max_blocks_per_seq or self.num_blocks) * self.block_size

    def pages_needed(self, seq_id, new_tokens):
        """Pages ``extend(seq_id, new_tokens)`` would allocate (0 while its last page has room)."""
        held = len(self._pages[self._check_id(seq_id)])
        return max(0, self._pages_for(self._lengths[seq_id] + new_tokens) - held)

    def room(self, seq_id=None):
        """Tokens ``seq_id`` can grow by now without ``OutOfPages`` or passing
        ``max_blocks_per_seq``: its last page's free slots plus the free pages. ``None``: a new
        sequence (``add_sequence(length)`` succeeds for ``length <= room()``)."""
        if seq_id is None:
            held, length = 0, 0
        else:
            held, length = len(self._pages[self._check_id(seq_id)]), self._lengths[seq_id]
        pages = min(held + len(self._free), self.max_blocks_per_seq or self.num_blocks)
        return pages * self.block_size - length

    def _grow(self, plan):
        """Give each (seq_id, new_length) of ``plan`` its pages: all or nothing."""
        need = {}
        for seq_id, new_length in plan:
            pages = self._pages_for(new_length)
            if self.max_blocks_per_seq is not None and pages > self.max_blocks_per_seq:
                raise ValueError(
                    f"sequence {seq_id}: length {new_length} needs {pages} pages, more than "
                    f"max_blocks_per_seq {self.max_blocks_per_seq}")
            need[seq_id] = max(0, pages - len(self._pages.get(seq_id, ())))
        total = sum(need.values())
        if total > len(self._free):
            raise OutOfPages(
                f"out of KV-cache pages: need {total} more page(s) of {self.block_size} tokens, "
                f"{len(self._free)} of {self.num_blocks} are free; free finished sequences "
                f"(PagedKVCache.free) or create the cache with more blocks")
        for seq_id, new_length in plan:
            if seq_id not in self._pages:
                self._pages[seq_id] = []
                self._new_slot(seq_id)
            owned = self._pages[seq_id]
            if need[seq_id]:
                self._take(seq_id, owned, need[seq_id])
            self._lengths[seq_id] = new_length

    def _new_slot(self, seq_id):
        if not self._free_slots:
            used = self._rows.shape[0]
            self._rows = np.concatenate([self._rows, np.full_like(self._rows, NO_PAGE)])
            self._free_slots = list(range(2 * used - 1, used - 1, -1))
        self._slot[seq_id] = self._free_slots.pop()

    def _take(self, seq_id, owned, count):
        """Append ``count`` free pages to ``owned`` (``seq_id``'s list) and to its table row."""
        start = len(owned)
        for _ in range(count):
            owned.append(self._free.pop())
        cap = self._rows.shape[1]
        if len(owned) > cap:
            while cap < len(owned):
                cap *= 2
            wider = np.full((self._rows.shape[0], cap), NO_PAGE, np.int32)
            wider[:, :self._rows.shape[1]] = self._rows
            self._rows = wider
        self._rows[self._slot[seq_id], start:len(owned)] = owned[start:]

    def add_sequence(self, length: int = 0) -> int:
        """Start a sequence of ``length`` tokens (its pages allocated); returns its id."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ValueError(f"length: expected an int >= 0, got {length!r}")
        seq_id = self._next_id
        self._grow([(seq_id, int(length))])
        self._next_id += 1
        return seq_id

    def extend(self, seq_ids: int | Iterable[int], new_tokens: int) -> None:
        """Grow each sequence of ``seq_ids`` (an id or a list of ids) by ``new_tokens`` tokens,
        allocating pages as needed; all or nothing (``OutOfPages``)."""
        ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)) or (
                new_tokens < 0):
            raise ValueError(f"new_tokens: expected an int >= 0, got {new_tokens!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids: expected distinct ids, got {ids}")
        self._grow([(i, self.length(i) + int(new_tokens)) for i in ids])

    def try_extend(self, seq_id, new_tokens):
        """``extend`` of one sequence if its pages fit (free pages, ``max_blocks_per_seq``);
        returns whether it grew. The lean form a scheduler calls once per sequence per step."""
        if new_tokens < 0:
            raise ValueError(f"new_tokens: expected an int >= 0, got {new_tokens!r}")
        length = self._lengths[self._check_id(seq_id)] + new_tokens
        owned = self._pages[seq_id]
        need = -(-length // self.block_size) - len(owned)
        if need > 0:
            if need > len(self._free) or (self.max_blocks_per_seq is not None and
                                          len(owned) + need > self.max_blocks_per_seq):
                return False
            self._take(seq_id, owned, need)
        self._lengths[seq_id] = length
        return True

    def extend_while_fits(self, seq_ids, new_tokens):
        """``try_extend(seq_id, new_tokens)`` of each of ``seq_ids`` in order, stopping at the
        first that does not fit (it, and those after it, unchanged); returns how many grew. A
        scheduler's steady decode step: one call, pages taken only where a last page is full."""
        if new_tokens < 0:
            raise ValueError(f"new_tokens: expected an int >= 0, got {new_tokens!r}")
        lengths, pages, free = self._lengths, self._pages, self._free
        block, cap = self.block_size, self.max_blocks_per_seq
        grown = 0
        for seq_id in seq_ids:
            if seq_id not in lengths:
                self._check_id(seq_id)
            length = lengths[seq_id] + new_tokens
            owned = pages[seq_id]
            if length > len(owned) * block:  # its last page is full: pages to take
                need = -(-length // block) - len(owned)
                if need > len(free) or (cap is not None and len(owned) + need > cap):
                    break
                self._take(seq_id, owned, need)
            lengths[seq_id] = length
            grown += 1
        return grown

    def free(self, seq_id: int) -> None:
        """Return a finished sequence's pages to the pool."""
        self._check_id(seq_id)
        pages = self._pages.pop(seq_id)
        self._free.extend(reversed(pages))
        del self._lengths[seq_id]
        slot = self._slot.pop(seq_id)
        self._rows[slot, :len(pages)] = NO_PAGE
        self._free_slots.append(slot)

    # ---- tables ----------------------------------------------------------------------------
    def host_tables(self, seq_ids: Iterable[int], *, lengths: Sequence[int] | None = None,
                    width: int | None = None,
                    out: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """NumPy int32 ``(block_table, seq_lens)`` of ``seq_ids`` in that order (the batch).

        ``width`` (columns of block_table) defaults to the most pages any of them holds (at
        least ``max_blocks_per_seq`` when set, and at least 1), or to the width of ``out``'s
        table; unused slots hold ``NO_PAGE``. ``lengths`` overrides the recorded lengths
        (``append`` passes the pre-append ones). ``out``: int32 ``(table, lens)`` arrays of at
        least as many rows as ``seq_ids`` to write the first rows of (a decode step's staged
        inputs); the written rows are returned.
        """
        ids = seq_ids if isinstance(seq_ids, list) else list(seq_ids)
        most = max(self.most_pages(ids), 1, self.max_blocks_per_seq or 1)
        if width is None:
            width = most if out is None else out[0].shape[1]
        width = int(width)
        if width < most:
            raise ValueError(f"width: expected at least {most} (the longest page list), got "
                             f"{width}")
        slot = self._slot
        rows = np.array([slot[i] for i in ids], np.intp)
        cap = self._rows.shape[1]
        lens = [self._lengths[i] for i in ids] if lengths is None else lengths
        if out is None:
            if width <= cap:
                table = self._rows[rows, :width]
            else:
                table = np.full((len(ids), width), NO_PAGE, np.int32)
                table[:, :cap] = self._rows[rows]
            return table, np.array(lens, np.int32)
        table, lens_out = _check_out(out, len(ids), width)
        if width <= cap:
            table[:] = self._rows[rows, :width]
        else:
            table[:, :cap] = self._rows[rows]
            table[:, cap:] = NO_PAGE
        lens_out[:] = lens
        return table, lens_out


def _check_out(out, n, width):
    """The first ``n`` rows of ``host_tables``'s ``out`` arrays, checked."""
    table, lens = out
    for name, a, shape in (("out[0]", table, (None, width)), ("out[1]", lens, (None,))):
        if not isinstance(a, np.ndarray) or a.dtype != np.int32 or a.ndim != len(shape) or (
                a.shape[0] < n) or a.shape[1:] != shape[1:]:
            want = ", ".join("rows" if s is None else str(s) for s in shape)
            got = (f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__)
            raise ValueError(f"{name}: expected an int32 NumPy array of shape ({want}) with "
                             f"rows >= {n}, got {got}")
    return table[:n], lens[:n]


class PagedKVCache(PageAllocator):
    """Paged K/V storage for many sequences plus their page tables.

    ``num_blocks`` pages of ``block_size`` tokens (a power of two, 8..256 for decode), each token
    holding ``nheads_k x headdim`` values of ``dtype``: float16 or bfloat16, as a name or a
    NumPy / ml_dtypes / torch dtype. ``kind``: "numba", "torch" or "cupy" (on a GPU, bfloat16
    needs "torch"). ``max_blocks_per_seq``: an optional limit on one sequence's pages
    (``ValueError`` past it); it is also the minimum width of the tables. ``num_layers``: None
    for one cache pair of (num_blocks, block_size, nheads_k, headdim), or the number of layers of
    a model, whose layers share the pages (one page id addresses the same slot of every layer):
    ``k_cache[layer]`` is then one layer's cache.

    Raises ``TypeError`` for arguments of the wrong type and unsupported dtypes, ``ValueError``
    for values out of range, ``NoCudaError`` without a GPU outside the simulator.
    """

    def __init__(self, num_blocks: int, block_size: int, nheads_k: int, headdim: int,
                 dtype: DTypeLike = "float16", *, kind: str = "numba",
                 max_blocks_per_seq: int | None = None, num_layers: int | None = None) -> None:
        super().__init__(num_blocks, block_size, max_blocks_per_seq=max_blocks_per_seq)
        for name, value in (("nheads_k", nheads_k), ("headdim", headdim),
                            ("num_layers", 1 if num_layers is None else num_layers)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value}")
        dtype = dtype_name(dtype, "dtype")
        if dtype not in ("float16", "bfloat16"):
            raise TypeError(f"dtype: expected float16 or bfloat16, got {dtype}")
        require_cuda()
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if not SIMULATOR and kind == "cupy" and dtype == "bfloat16":
            raise TypeError("kind: CuPy has no bfloat16; use kind='torch'")
        if not SIMULATOR and kind == "numba" and dtype == "bfloat16":
            raise TypeError("kind: numba device arrays cannot hold bfloat16; use kind='torch'")
        self.nheads_k = int(nheads_k)
        self.headdim = int(headdim)
        self.dtype = dtype
        self.kind = kind
        self.num_layers = None if num_layers is None else int(num_layers)
        shape: tuple[int, ...] = (self.num_blocks, self.block_size, self.nheads_k, self.headdim)
        if self.num_layers is not None:
            shape = (self.num_layers,) + shape
        self.k_cache = self._zeros(shape, dtype)
        self.v_cache = self._zeros(shape, dtype)

    # ---- device arrays ---------------------------------------------------------------------
    def _zeros(self, shape, dtype):
        if SIMULATOR:
            return np.zeros(shape, numpy_dtype(dtype))
        if self.kind == "torch":
            import torch

            return torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda")
        if self.kind == "cupy":
            import cupy

            return cupy.zeros(shape, dtype=dtype)
        from numba.cuda.cudadrv.driver import device_memset

        out = cuda.device_array(shape, dtype=np.float16)
        device_memset(out, 0, out.nbytes)
        return out

    def _to_device(self, host):
        host = np.ascontiguousarray(host, dtype=np.int32)
        if SIMULATOR:
            return host
        if self.kind == "torch":
            import torch

            return torch.from_numpy(host).cuda()
        if self.kind == "cupy":
            import cupy

            return cupy.asarray(host)
        return cuda.to_device(host)

    def tables(self, seq_ids: Iterable[int], *,
               width: int | None = None) -> tuple[ArrayLike, ArrayLike]:
        """Device int32 ``(block_table, seq_lens)`` of ``seq_ids`` (the decode batch, in order),
        in the cache's array kind. See ``host_tables``."""
        table, lens = self.host_tables(seq_ids, width=width)
        return self._to_device(table), self._to_device(lens)

    def append(self, seq_ids: Iterable[int], k: ArrayLike, v: ArrayLike, *,
               stream: StreamLike = None,
               width: int | None = None) -> tuple[ArrayLike, ArrayLike]:
        """Append ``k``, ``v`` (batch, new_tokens, nheads_k, headdim) to the sequences
        ``seq_ids`` (one per batch row): allocate their pages (all or nothing), write the tokens
        with ``paged_kv_append``, and return the device ``(block_table, seq_lens)`` *after* the
        append, ready for ``paged_decode_attention`` with ``q_len = new_tokens``. A cache of
        ``num_layers`` layers is written layer by layer with ``paged_kv_append`` instead."""
        from ._arrays import as_tensor
        from .ops.paged_kv_append import paged_kv_append

        if self.num_layers is not None:
            raise ValueError("append: this cache has num_layers layers; write each layer's "
                             "k_cache[layer] with paged_kv_append and the tables of extend / "
                             "host_tables")
        ids = list(seq_ids)
        tk = as_tensor(k, "k")
        if tk.ndim != 4 or tk.shape[0] != len(ids):
            raise ValueError(f"k: expected shape ({len(ids)}, new_tokens, {self.nheads_k}, "
                             f"{self.headdim}) for {len(ids)} sequences, got {tk.shape}")
        before = [self.length(i) for i in ids]
        self.extend(ids, tk.shape[1])
        table, _ = self.host_tables(ids, width=width)
        block_table = self._to_device(table)
        paged_kv_append(k, v, self.k_cache, self.v_cache, block_table,
                        self._to_device(np.array(before, np.int32)), stream=stream)
        return block_table, self._to_device(np.array([self._lengths[i] for i in ids],
                                                     np.int32))

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.num_blocks} x {self.block_size} tokens, nheads_k "
                f"{self.nheads_k}, headdim {self.headdim}, {self.dtype}, {self.kind}; "
                f"{len(self._lengths)} sequences, {len(self._free)} free pages)")
