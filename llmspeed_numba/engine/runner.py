"""Runs one scheduled engine step (a scheduler ``Batch``) on the model and samples its tokens.

A step has up to two passes over the weights:

- decode entries (one token each), batched, replayed from a CUDA graph per (batch bucket, table
  width bucket): the batch is padded to the next bucket of ``BATCH_BUCKETS`` with rows that feed
  a reserved scratch page, so a few graphs serve every batch size;
- prefill entries (prompt chunks), packed into one eager forward: chunks that start a sequence
  first (``flash_attn_varlen``), then chunks that continue one (``paged_prefill_attention``
  over their caches, one launch for all of them).

Tokens are drawn by the ``sample`` op from per-row parameters. A row's seed mixes the request's
seed with the position of the token drawn, so a request's tokens do not depend on what else was
batched with it, nor on being recomputed after a preemption.
"""

import os
import sys
import time

import numpy as np

from ..models.decode_graph import SAMPLING_PARAMS, DecodeGraph
from ..models.llama import Step, decode_step, to_device

#: Decode batch sizes with a graph of their own; other sizes are padded to the next one.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Fewest pages a decode block table is wide (wider tables are rounded up to a power of two).
MIN_WIDTH = 16
_SEED_MIX = 0x9E3779B97F4A7C15
#: One request's sampling row as ``_params`` caches it: ``SAMPLING_PARAMS`` but the seed, then
#: the request's seed times ``_SEED_MIX`` (mod 2**64), which ``row_seed`` xors with position + 1.
_ROW = np.dtype([(name, dtype) for name, dtype in SAMPLING_PARAMS[:-1]] + [("mix", "uint64")])
assert [name for name, _ in SAMPLING_PARAMS] == ["temperature", "top_k", "top_p", "min_p",
                                                 "seed"] and _ROW.itemsize == 24


def _bucket(n, buckets):
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch of {n} decodes exceeds the largest bucket {buckets[-1]}")


def prefill_sizes(max_tokens):
    """Prefill step sizes (new tokens) whose kernels ``ModelRunner.warm_up`` makes ready: each
    power of two up to ``max_tokens``, the size one past it, and ``max_tokens`` (GEMM tiles and
    attention configurations change at such bounds)."""
    sizes, n = {max_tokens}, 1
    while n <= max_tokens:
        sizes.update((n, min(n + 1, max_tokens)))
        n *= 2
    return sorted(sizes)


def row_seed(seed, position):
    """The sampler seed of the token at ``position`` of a request seeded ``seed`` (int64)."""
    x = ((int(seed) * _SEED_MIX) ^ (int(position) + 1)) & (2**64 - 1)
    return x - 2**64 if x >= 2**63 else x


def _fed_token(entry):
    """The one token a decode entry feeds: ``entry.token_ids[0]`` without the list slice."""
    r, start = entry.request, entry.start_position
    i = start - len(r.prompt_token_ids)
    return r.output_token_ids[i] if i >= 0 else r.prompt_token_ids[start]


def _sampling_row(request):
    """``(params, sampling_seed, bytes of one _ROW record)``: each value converted as a
    one-element array of its ``SAMPLING_PARAMS`` dtype, as ``_params`` converted its columns."""
    p, seed = request.params, request.sampling_seed
    values = (p.temperature, p.top_k, p.top_p, p.min_p, (int(seed) * _SEED_MIX) & (2**64 - 1))
    blob = b"".join(np.array([v], _ROW[i]).tobytes() for i, v in enumerate(values))
    return p, seed, blob


class DecodeLaunch:
    """A decode step started by ``ModelRunner.launch_decode``: its graph, its ``n`` real rows,
    whether the graph was replayed (not run eagerly before its capture), and its two timing
    marks (None off the GPU and for a graph's first step)."""

    __slots__ = ("graph", "n", "replayed", "marks")

    def __init__(self, graph, n, replayed, marks):
        self.graph, self.n, self.replayed, self.marks = graph, n, replayed, marks

    def begin_read(self):
        self.graph.begin_read()
        if self.marks is not None:
            self.marks[1].record()


class ModelRunner:
    """Executes scheduler batches for ``llama`` over ``cache`` (a ``PagedKVCache`` whose
    allocator the scheduler uses). ``scratch_page``: a page owned by no sequence, where padded
    decode rows write. ``cuda_graphs``: replay decode steps from graphs (GPU only)."""

    def __init__(self, llama, cache, *, scratch_page, cuda_graphs, max_width):
        self.llama, self.cache = llama, cache
        self.scratch_page = scratch_page
        self.cuda_graphs = cuda_graphs
        self.max_width = max_width
        self.graphs = {}
        self.pool = None
        #: the last step's decode replayed from a graph, and the seconds the host waited for it
        self.last_replayed = False
        self.last_wait = 0.0
        #: seconds the GPU had nothing to run between the last read decode step and the graph
        #: decode step before it (``launch_decode``'s timing marks; None when not measured)
        self.last_gpu_idle = None
        self._marks = None          # (start, end) timing events of two launches, in turn
        self._launches = 0
        self._last_end = None       # end mark of the last graph decode step read

    @property
    def chains(self):
        """Whether a decode step can start before the previous one's tokens are read
        (``launch_decode(after=...)``): graphs on, and this process runs every rank's steps
        (a tensor-parallel runner's workers need each step's tokens from the host)."""
        return self.cuda_graphs and type(self) is ModelRunner

    # ---- host inputs ---------------------------------------------------------------------------

    def _device(self, array):
        return to_device(array, self.llama.device)

    @staticmethod
    def _params(entries, out=None):
        """Per-row sampling arrays (``SAMPLING_PARAMS`` order) of the entries' next tokens; with
        ``out`` (one array per ``SAMPLING_PARAMS`` entry, of at least ``len(entries)`` rows, a
        decode step's staged inputs) written into its first rows instead.

        Each request's row is packed once (``_sampling_row``, kept in ``request.sampling_row``
        while its ``params`` object and ``sampling_seed`` stay the same); a step joins the rows
        and mixes in the positions: the values of ``row_seed``, bit for bit."""
        if not entries:
            if out is not None:
                return out
            return tuple(np.array((), dtype) for _, dtype in SAMPLING_PARAMS)
        packed, positions = [], []
        for e in entries:
            r = e.request
            row = r.sampling_row
            if row is None or row[0] is not r.params or row[1] != r.sampling_seed:
                row = r.sampling_row = _sampling_row(r)
            packed.append(row[2])
            positions.append(e.start_position + e.num_new_tokens)
        table = np.frombuffer(b"".join(packed), _ROW)
        mixed = np.array(positions, np.uint64) + np.uint64(1)
        if out is None:
            seeds = table["mix"] ^ mixed
            return (table["temperature"].copy(), table["top_k"].copy(), table["top_p"].copy(),
                    table["min_p"].copy(), seeds.view(np.int64))
        n = len(entries)
        for column, name in zip(out, _ROW.names[:4]):
            column[:n] = table[name]
        np.bitwise_xor(table["mix"], mixed, out=out[4][:n].view(np.uint64))
        return out

    def _width(self, longest_pages):
        width = MIN_WIDTH
        while width < longest_pages:
            width *= 2
        return min(width, max(self.max_width, longest_pages))

    def decode_shapes(self, max_rows):
        """``(rows, width)`` of every decode graph a step of up to ``max_rows`` decodes can
        replay: each batch bucket up to ``max_rows``'s, by each table width ``_width`` gives."""
        top = _bucket(max_rows, BATCH_BUCKETS)
        widths, pages = [], MIN_WIDTH
        while True:
            width = self._width(min(pages, self.max_width))
            if width not in widths:
                widths.append(width)
            if pages >= self.max_width:
                break
            pages *= 2
        return [(rows, width) for rows in BATCH_BUCKETS if rows <= top for width in widths]

    def warm_up(self, max_rows, max_tokens, *, page_tokens, max_model_len, log=None,
                marker=None, compile=None):
        """Make every kernel a step can launch ready and capture every decode graph, so that no
        step of a load compiles or captures: the decode steps of ``decode_shapes(max_rows)`` and
        prefill steps of each of ``prefill_sizes(max_tokens)`` new tokens (one prompt from its
        start, one chunk continuing a sequence of ``page_tokens`` cached tokens, each within
        ``max_model_len``) are run under ``collecting_kernels`` (nothing launched), the kernels
        neither resolved nor in the machine-code store compiled by ``compile`` (default
        ``warm.compile_with_progress``: parallel processes, a progress bar on ``log``), then
        each decode graph captured (one step of padding rows, which write only the scratch
        page). ``marker``: a file that, once written by a warm-up whose kernels all compiled,
        lets later ones skip the listing (a kernel missing after all compiles at its first
        launch). A tensor-parallel runner's workers cannot follow the listing: each rank
        compiles its own while capturing. Returns the seconds it took."""
        from ..warm import compile_with_progress, kernels_of, unresolved

        start = time.perf_counter()
        shapes = self.decode_shapes(max_rows) if self.cuda_graphs else []
        if type(self) is ModelRunner and not (marker and os.path.exists(marker)):
            def workload():
                for rows, width in shapes:
                    staged = self._graph(rows, width).staged()
                    step = decode_step(self.llama.device, staged.token_ids, staged.positions,
                                       staged.table, staged.seq_lens)
                    self._sample(self._run(step), staged.params)
                for tokens in prefill_sizes(max_tokens):
                    for cached in (0, page_tokens):
                        if cached + tokens <= max_model_len:
                            self._prefill_probe(tokens, cached, page_tokens)

            missing = unresolved(kernels_of(workload))
            failed = (compile or compile_with_progress)(missing, log=log or sys.stderr,
                                                        what="warm-up") if missing else []
            if marker and not failed:
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                with open(marker, "w") as f:
                    f.write(f"{len(missing)} kernels compiled\n")
        for rows, width in shapes:
            staged = self._graph(rows, width).staged()
            staged.pad(0)
            self.run_decode(staged.token_ids, staged.positions, staged.table, staged.seq_lens,
                            staged.params)
        self.last_replayed, self.last_wait = False, 0.0
        return time.perf_counter() - start

    def _prefill_probe(self, tokens, cached, page_tokens):
        """``ModelRunner.run_prefill`` of one sequence's ``tokens`` new tokens after ``cached``
        ones (0: a prompt from its start, else a chunk continuing it), greedy, every page the
        scratch page: for listing the kernels of such a step."""
        pages = -(-(cached + tokens) // page_tokens)
        table = np.full((1, pages), self.scratch_page, np.int32)
        bounds = np.array([0, tokens], np.int32)
        fields = dict(token_ids=np.zeros(tokens, np.int64),
                      positions=np.arange(cached, cached + tokens, dtype=np.int32),
                      last_rows=np.array([tokens - 1], np.int64))
        if cached == 0:
            fields.update(cu_seqlens=bounds, max_seqlen=tokens, fresh_tokens=tokens)
        else:
            fields.update(cu_seqlens=bounds[:1], max_seqlen=0, fresh_tokens=0,
                          chunk_cu_seqlens=bounds, chunk_max_seqlen=tokens,
                          chunk_block_table=table,
                          chunk_seq_lens=np.array([cached + tokens], np.int32))
        params = tuple(np.zeros(1, dtype) for _, dtype in SAMPLING_PARAMS)
        self.run_prefill(table, [tokens], fields, params)

    # ---- passes --------------------------------------------------------------------------------

    def execute(self, batch):
        """Run ``batch``; returns ``{request_id: token}`` for its sampling entries."""
        entries = batch.entries
        decodes, prefills = entries[:batch.num_decodes], entries[batch.num_decodes:]
        self.last_replayed, self.last_wait = False, 0.0
        self._last_end = None   # the next timing mark's gap would span this step
        sampling = set(batch.sample_indices)
        out = {}
        if decodes:
            for e, token in zip(decodes, self._decode(decodes)):
                out[e.request.request_id] = token
        if prefills:
            tokens = self._prefill(prefills)
            for i, (e, token) in enumerate(zip(prefills, tokens), start=len(decodes)):
                if i in sampling:
                    out[e.request.request_id] = token
        return out

    def _decode(self, entries):
        allocator = self.cache
        seqs = [e.seq_id for e in entries]
        width = self._width(allocator.most_pages(seqs))
        n = len(entries)
        if not self.cuda_graphs:
            table, seq_lens = allocator.host_tables(seqs, width=width)
            tokens = np.array([_fed_token(e) for e in entries], np.int64)
            positions = np.array([e.start_position for e in entries], np.int32)
            return self.run_decode(tokens, positions, table, seq_lens, self._params(entries))
        staged = self._graph(_bucket(n, BATCH_BUCKETS), width).staged()
        self._stage(entries, seqs, staged)
        return self.run_decode(staged.token_ids, staged.positions, staged.table,
                               staged.seq_lens, staged.params)[:n]

    def launch_decode(self, entries, after=None, rows=None):
        """Start the decode step of ``entries`` (graphs on: ``chains``) without waiting for
        it; ``collect_decode`` returns its tokens. ``after``: the ``DecodeLaunch`` of the step
        before, not yet collected, whose entries are these, row for row: its sampled tokens,
        still on the GPU, are this step's inputs (the staged ones are placeholders), so the
        GPU runs the two back to back while the host reads the first. ``rows``: when the
        entries are not ``after``'s row for row, the row of ``after`` each takes its token
        from (-1: its own, on the host). Without ``after`` the token read starts at once; with
        it, when ``after`` is collected."""
        n = len(entries)
        seqs = [e.seq_id for e in entries]
        graph = self._graph(_bucket(n, BATCH_BUCKETS), self._width(self.cache.most_pages(seqs)))
        staged = graph.staged()
        self._stage(entries, seqs, staged)
        if rows is not None:
            staged.source_rows[:n] = rows
        replayed = graph.graph is not None
        marks = None
        if graph.capture and replayed:
            if self._marks is None:
                import torch

                self._marks = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
                               for _ in range(2)]
            marks = self._marks[self._launches % 2]
            self._launches += 1
            marks[0].record()
        graph.launch(n, tokens_from=None if after is None else after.graph.tokens,
                     rows=rows is not None)
        launch = DecodeLaunch(graph, n, replayed, marks)
        if after is None:
            launch.begin_read()
        return launch

    def collect_decode(self, launch, following=None):
        """The tokens of ``launch`` (a list; waits for them), then the read of ``following``
        (the launch made ``after`` it) begun. Sets ``last_replayed``, ``last_wait`` and
        ``last_gpu_idle``."""
        tokens = launch.graph.finish_read(launch.n)
        self.last_replayed, self.last_wait = launch.replayed, launch.graph.last_wait
        self.last_gpu_idle = None
        if launch.marks is not None:
            if self._last_end is not None:  # both marks have passed: the wait covered them
                self.last_gpu_idle = max(0.0, 1e-3 * self._last_end.elapsed_time(
                    launch.marks[0]))
            self._last_end = launch.marks[1]
        else:
            self._last_end = None
        if following is not None:
            following.begin_read()
        return tokens

    def _stage(self, entries, seqs, staged):
        """Write the decode entries' inputs into rows ``0 .. len(entries)-1`` of ``staged`` (a
        ``StagedInputs``; ``seqs`` their sequence ids) and pad the rest: no array in between."""
        n = len(entries)
        self.cache.host_tables(seqs, width=staged.width, out=(staged.table, staged.seq_lens))
        tokens, positions = [], []
        for e in entries:  # _fed_token inlined: a call per row costs as much as the rest
            r, start = e.request, e.start_position
            i = start - len(r.prompt_token_ids)
            tokens.append(r.output_token_ids[i] if i >= 0 else r.prompt_token_ids[start])
            positions.append(start)
        staged.token_ids[:n] = tokens
        staged.positions[:n] = positions
        self._params(entries, out=staged.params)
        staged.pad(n)

    def _graph(self, rows, width):
        """The ``DecodeGraph`` of a batch bucket and table width (made on first use)."""
        graph = self.graphs.get((rows, width))
        if graph is None:
            graph = self.graphs[rows, width] = DecodeGraph(
                self.llama, self.cache, rows, width, sampling=True, pool=self.pool,
                pad_page=self.scratch_page)
        return graph

    def run_decode(self, tokens, positions, table, seq_lens, params):
        """The decode pass of host (NumPy) inputs, padded to a batch bucket with graphs: each
        row's sampled token (a list). ``run_decode`` and ``run_prefill`` are all the device work
        of a step: a tensor-parallel worker repeats them with rank 0's inputs. With graphs,
        inputs that are the graph's staged ones (``_decode`` wrote them there) are used where
        they are; others (a worker's) are copied into them."""
        if not self.cuda_graphs:
            step = decode_step(self.llama.device, tokens, positions, table, seq_lens)
            return self._sample(self._run(step), params)
        rows = len(tokens)
        graph = self._graph(rows, table.shape[1])
        replayed = graph.graph is not None
        if tokens is graph.inputs.token_ids:
            tokens = graph.replay(rows)
        else:
            tokens = graph.run(tokens, positions, table, seq_lens, params)
        self.pool = graph.pool
        self.last_replayed, self.last_wait = replayed, graph.last_wait
        return tokens

    def _prefill(self, entries):
        """One packed forward of the prefill chunks: each entry's next token (a list)."""
        allocator = self.cache
        order = sorted(range(len(entries)), key=lambda i: entries[i].start_position > 0)
        ordered = [entries[i] for i in order]
        lengths = [e.num_new_tokens for e in ordered]
        seqs = [e.seq_id for e in ordered]
        table, seq_lens = allocator.host_tables(seqs)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        fresh = [i for i, e in enumerate(ordered) if e.start_position == 0]
        cu = bounds[:len(fresh) + 1].astype(np.int32)
        chunks = {}
        if len(fresh) < len(ordered):      # chunks continuing a sequence: rows after the fresh
            rest = slice(len(fresh), len(ordered))
            chunks = dict(
                chunk_cu_seqlens=(bounds[len(fresh):] - cu[-1]).astype(np.int32),
                chunk_max_seqlen=max(lengths[rest]),
                chunk_block_table=table[rest],
                chunk_seq_lens=seq_lens[rest])
        fields = dict(
            token_ids=np.concatenate([e.token_ids for e in ordered]).astype(np.int64),
            positions=np.concatenate([
                np.arange(e.start_position, e.start_position + e.num_new_tokens, dtype=np.int32)
                for e in ordered]),
            last_rows=bounds[1:].astype(np.int64) - 1,
            cu_seqlens=cu, max_seqlen=max([lengths[i] for i in fresh] or [0]),
            fresh_tokens=int(cu[-1]), **chunks)
        tokens = self.run_prefill(table, lengths, fields, self._params(ordered))
        result = [None] * len(entries)
        for slot, i in enumerate(order):
            result[i] = tokens[slot]
        return result

    def run_prefill(self, table, lengths, fields, params):
        """The prefill pass: ``fields`` the ``Step``'s but its token tables, arrays on the host
        (NumPy); each sequence's ``lengths`` new tokens take its row of ``table``. Returns each
        sequence's sampled token (a list)."""
        step = Step(token_tables=self._device(np.repeat(table, lengths, axis=0)),
                    **{name: self._device(value) if isinstance(value, np.ndarray) else value
                       for name, value in fields.items()})
        return self._sample(self._run(step), params)

    def _run(self, step):
        return self.llama.forward(step, self.cache)

    def _sample(self, logits, params):
        arrays = {name: self._device(col) for (name, _), col in zip(SAMPLING_PARAMS, params)}
        return self.llama.ops.sample(logits, **arrays).tolist()
