"""A decode step captured once as a CUDA graph and replayed for every later token.

An eager decode step of a 32-layer model makes about 400 op calls from Python, each costing the
host tens of microseconds, so the host, not the GPU, sets the speed. A replayed graph launches the
same kernels for a few microseconds in all. The step's inputs (token ids, positions, block table,
lengths and, when sampling, each row's sampling parameters) live in one device buffer the graph
captured (``StagedInputs``); the caller writes each step's values straight into NumPy views of a
pinned host twin of that buffer, one asynchronous copy moves them, and the graph replays. The
sampled tokens come back through a small pinned buffer, one copy and an event.

The first step of a graph runs eagerly on those tensors (its result is used: capture itself runs
nothing), which also compiles every kernel and creates the ops' workspaces before capture. Off
the GPU (the simulator) nothing is captured and every step runs eagerly on the same inputs.
"""

import time

import numpy as np

from .._workspace import graph_owned
from .llama import Step

#: Each row's sampling parameters, in ``DecodeGraph.run``'s ``params`` order, and their dtypes.
SAMPLING_PARAMS = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"),
                   ("min_p", "float32"), ("seed", "int64"))

#: Bytes each input starts at a multiple of (as a device allocation of its own would): kernels
#: that read the tables with vector loads see the alignment they saw before.
_ALIGN = 256


class StagedInputs:
    """A decode step's inputs for ``rows`` rows and block tables ``width`` pages wide, in one
    host buffer (pinned on a GPU, so the copy is a real asynchronous DMA; a plain tensor
    elsewhere) and one device buffer of ``device`` laid out alike.

    NumPy views of the host buffer, written by the caller: ``token_ids`` (rows,) int64,
    ``positions`` (rows,) int32, ``table`` (rows, width) int32, ``seq_lens`` (rows,) int32,
    ``source_rows`` (rows,) int64 (``DecodeGraph.launch``'s row map, written only for it) and,
    with ``sampling``, ``params``: one (rows,) array per ``SAMPLING_PARAMS`` entry. ``on_device``:
    the torch views of the device buffer of the same names (the graph's inputs).

    Writing: ``writable()`` first (it waits until no copy from the host buffer can still be
    running), then rows ``0 .. n-1`` of every input, then ``pad(n)``, which makes rows ``n ..``
    padding (token 0, position 0, every page ``pad_page``, length 1, sampling parameters 0) by
    rewriting only those a previous step left real. ``copy()`` moves the whole buffer with one
    asynchronous copy on the current stream; ``copied()`` says the stream has passed it (the
    caller synchronised on later work of that stream).

    One host buffer, not two used in turn: a step's copy is always complete when the next step
    writes (the step ends by synchronising on its sampled tokens, read after the copy on the same
    stream), so the wait in ``writable`` only guards a step that ended early (an exception
    between the copy and the read): an event, checked only then, costs nothing in the usual
    case, where a second buffer would double the pinned memory and the views for nothing.
    """

    def __init__(self, rows, width, *, sampling, device, pad_page=0):
        import torch

        fields = [("token_ids", (rows,), "int64"), ("positions", (rows,), "int32"),
                  ("table", (rows, width), "int32"), ("seq_lens", (rows,), "int32"),
                  ("source_rows", (rows,), "int64")]
        if sampling:
            fields += [(name, (rows,), dtype) for name, dtype in SAMPLING_PARAMS]
        layout, nbytes = [], 0
        for name, shape, dtype in fields:
            layout.append((name, shape, np.dtype(dtype), nbytes))
            nbytes += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        self.rows, self.width, self.pad_page = rows, width, pad_page
        self.pinned = torch.device(device).type == "cuda"
        self.host = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pinned)
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        raw = self.host.numpy()
        self.on_device = {}
        for name, shape, dtype, offset in layout:
            size = int(np.prod(shape)) * dtype.itemsize
            setattr(self, name, raw[offset:offset + size].view(dtype).reshape(shape))
            self.on_device[name] = self.buffer[offset:offset + size].view(
                getattr(torch, dtype.name)).view(shape)
        self.params = tuple(getattr(self, name) for name, _ in SAMPLING_PARAMS) if sampling else ()
        self._event = torch.cuda.Event() if self.pinned else None
        self._in_flight = False
        #: ``copy`` calls so far (a reader knows whether its wait also covered the last one)
        self.copies = 0
        self._real_rows = rows  # rows from this one on hold padding
        self.pad(0)

    def writable(self):
        """``self``, once no copy from the host buffer can still be running."""
        if self._in_flight:
            self._event.synchronize()
            self._in_flight = False
        return self

    def pad(self, n):
        """Rows ``n ..`` of every input hold padding (see the class docstring)."""
        stale = slice(n, self._real_rows)
        if n < self._real_rows:
            self.token_ids[stale] = 0
            self.positions[stale] = 0
            self.table[stale] = self.pad_page
            self.seq_lens[stale] = 1
            for column in self.params:
                column[stale] = 0
        self._real_rows = n

    def copy(self):
        """One asynchronous host-to-device copy of every input (current stream)."""
        self.buffer.copy_(self.host, non_blocking=True)
        self.copies += 1
        if self._event is not None:
            self._event.record()
            self._in_flight = True

    def copied(self):
        """The current stream has passed the last ``copy`` (the caller synchronised on it)."""
        self._in_flight = False


class DecodeGraph:
    """Decode steps of ``batch`` sequences with block tables ``width`` pages wide, over
    ``cache``, for ``llama`` (a ``LlamaModel``): greedy (``argmax``), or with ``sampling`` the
    ``sample`` op on per-row parameters. ``pool``: a graph memory pool to share with other
    graphs replayed one at a time (``DecodeGraph.pool`` of another). ``pad_page``: the page the
    table rows of padding point to (``StagedInputs.pad``)."""

    def __init__(self, llama, cache, batch, width, *, sampling=False, pool=None, pad_page=0):
        import torch

        self.llama, self.cache, self.sampling, self.pool = llama, cache, sampling, pool
        device = torch.device(llama.device)
        self.capture = device.type == "cuda"
        self.inputs = StagedInputs(batch, width, sampling=sampling, device=device,
                                   pad_page=pad_page)
        staged = self.inputs.on_device
        self.params = tuple(staged[name] for name, _ in SAMPLING_PARAMS) if sampling else ()
        self.step = Step(token_ids=staged["token_ids"], positions=staged["positions"],
                         token_tables=staged["table"],
                         last_rows=torch.arange(batch, dtype=torch.int64, device=device),
                         block_table=staged["table"], seq_lens=staged["seq_lens"])
        self.graph = None
        self._workspaces = None    # the captured graph's own workspaces (freed with it)
        self.next_tokens = None    # the captured graph's output
        self.tokens = None         # the last launched step's sampled tokens (device)
        self._read_after_copies = 0
        self._tokens_host = None   # pinned twin of the sampled tokens, and its NumPy view
        self._tokens_np = None
        self._read = torch.cuda.Event() if self.capture else None
        #: seconds the host waited for the GPU in the last replayed step (reading its tokens)
        self.last_wait = 0.0

    def _forward(self):
        if not self.sampling:
            return self.llama.greedy(self.step, self.cache)
        logits = self.llama.forward(self.step, self.cache)
        return self.llama.ops.sample(
            logits, **{name: value for (name, _), value in zip(SAMPLING_PARAMS, self.params)})

    def staged(self):
        """The ``StagedInputs`` to write this step's rows into (ready to be written)."""
        return self.inputs.writable()

    def replay(self, n):
        """One decode step on the staged inputs (rows ``0 .. n-1`` real, the rest padded):
        returns the next tokens of the first ``n`` rows (a list)."""
        self.launch(n)
        self.begin_read()
        return self.finish_read(n)

    def launch(self, n, tokens_from=None, rows=False):
        """Start one decode step on the staged inputs without waiting for it; its sampled
        tokens are ``self.tokens`` (a device tensor, valid until the next launch). With
        ``tokens_from`` (a device tensor: the previous step's ``tokens``, not yet read), its
        first ``n`` values replace the staged token ids of rows ``0 .. n-1`` on the device,
        after the inputs' copy: the step continues the previous one without the host knowing
        its tokens. With ``rows``, row ``i`` takes ``tokens_from[source_rows[i]]`` instead
        (the staged ``source_rows``; -1 keeps the staged token id). A graph's first step runs
        eagerly (which compiles its kernels and makes the ops' workspaces), then it is
        captured (capture runs nothing)."""
        self.inputs.copy()
        if tokens_from is not None:
            fed = self.inputs.on_device["token_ids"][:n]
            if not rows:
                fed.copy_(tokens_from[:n])
            else:
                import torch

                source = self.inputs.on_device["source_rows"][:n]
                fed.copy_(torch.where(source >= 0, tokens_from[source.clamp(min=0)], fed))
        if self.graph is not None:
            self.graph.replay()
            self.tokens = self.next_tokens
            return
        self.tokens = self._forward()
        if self.capture:
            import torch

            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # the capture's own workspaces live with this object, not the process:
            # generate_greedy captures new graphs at every call
            with graph_owned() as self._workspaces, torch.cuda.graph(graph, pool=self.pool):
                self.next_tokens = self._forward()
            self.graph, self.pool = graph, graph.pool()

    def begin_read(self):
        """Copy the last launch's ``tokens`` into a pinned buffer, then record an event
        (asynchronous; ``finish_read`` waits)."""
        tokens = self.tokens
        host = self._tokens_host
        if host is None or host.dtype != tokens.dtype or host.shape != tokens.shape:
            import torch

            host = self._tokens_host = torch.empty(tokens.shape, dtype=tokens.dtype,
                                                   pin_memory=self.capture)
            self._tokens_np = host.numpy()
        host.copy_(tokens, non_blocking=True)
        if self._read is not None:
            self._read.record()
        self._read_after_copies = self.inputs.copies

    def finish_read(self, n):
        """The first ``n`` tokens of the step ``begin_read`` copied, as a list: a wait on its
        event (the time waited: ``last_wait``)."""
        if self._read is not None:
            start = time.perf_counter()
            self._read.synchronize()
            self.last_wait = time.perf_counter() - start
        if self._read_after_copies == self.inputs.copies:
            self.inputs.copied()  # read after the inputs' last copy, on the same stream
        return self._tokens_np[:n].tolist()

    def run(self, token_ids, positions, table, seq_lens, params=()):
        """One decode step from host (NumPy) inputs of ``n <= batch`` rows, ``params`` the
        per-row sampling arrays when sampling; returns the next tokens (a list)."""
        staged = self.staged()
        n = len(token_ids)
        for dst, src in zip((staged.token_ids, staged.positions, staged.table, staged.seq_lens)
                            + staged.params, (token_ids, positions, table, seq_lens) + tuple(params)):
            dst[:n] = src
        staged.pad(n)
        return self.replay(n)
