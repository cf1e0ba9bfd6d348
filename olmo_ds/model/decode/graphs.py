"""The decode step as CUDA graphs: on a GPU a step's kernels launch as one replay, at any number of active sequences.

A decode step of a 1B model at batch 64 is a few milliseconds of GPU work behind hundreds of kernel launches
that Python issues one by one, so eagerly the host, not the GPU, sets the pace. A step's shape is its rows and
the span its attention reads: rows are the active sequences padded to a bucket (`cache.row_bucket`: powers of two
up to the slots), the span one of a few multiples of `SPAN_BUCKET` (`cache.decode_span`). Each (rows, span) met
is captured once, lazily, into a CUDA graph over static input buffers (ids, positions, slot of each row) and
replayed, so the tail of a generation (fewer sequences than slots) replays graphs as the full batch does. Padding
rows decode token 0 at position 0 of the cache's scratch slot, which no sequence holds: their writes land where
nothing reads them, and their logits are dropped. The engine pads its eager steps the same way, so a graph
runs the eager step's kernels on the same shapes and returns the same logits.

The graphs share one memory pool: they replay one at a time on one stream, and every graph's output (its
logits) is read on that stream before the next replay, so one graph's temporaries may sit where another's
were. Every graph's output stays referenced, so no capture reuses it. A capture that fails turns graphs off
for the run, with one line on stderr; decoding goes on eagerly.
"""

from __future__ import annotations

import sys

import torch

from olmo_ds.model.decode.cache import SlotCache, row_bucket
from olmo_ds.model.decode.compiled import CompiledStep
from olmo_ds.model.decode.forward import forward_logits
from olmo_ds.model.model import OLMo


class DecodeGraphs:
    """Graphs of the decode step of one `SlotCache` (built with a scratch slot), one per (rows, span)."""

    def __init__(self, model: OLMo, cache: SlotCache, step: CompiledStep | None = None):
        if cache.scratch is None:
            raise ValueError("DecodeGraphs needs a SlotCache with a scratch slot (SlotCache(..., scratch=True)) for its padding rows")
        self.model, self.cache, self.step = model, cache, step
        device = cache.keys[0].device
        self.ids = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(cache.slots, dtype=torch.long, device=device)
        self.slots = torch.full((cache.slots,), cache.scratch, dtype=torch.long, device=device)
        self.layout: tuple | None = None  # the slots in `self.slots` now: rows are refilled only when they change
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.enabled = True
        self.replays = 0

    def _forward(self, rows: int, span: int, contiguous: bool) -> torch.Tensor:
        slots, positions = self.slots[:rows], self.positions[:rows]
        self.cache.decode(slots, positions, span, contiguous=contiguous)
        return forward_logits(self.model, self.ids[:rows], positions[:, None], self.cache, torch.arange(rows, device=slots.device),
                              self.step)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int], span: int) -> torch.Tensor | None:
        """Logits [len(slots), padded_vocab] of the step feeding `ids` [A, 1] at `positions` [A] (device tensors) into
        cache slots `slots` (A distinct slots, as ints), or None when graphs are off (the caller runs the step
        eagerly). The result is a view of the graph's output buffer: read it before the next call."""
        if not self.enabled:
            return None
        active = len(slots)
        rows = row_bucket(active, self.cache.slots)
        # The SDPA kernel reads slots 0..rows-1 through views when those are the rows; the Triton kernel reads by index.
        contiguous = self.cache.kernel == "sdpa" and active == rows and slots == list(range(rows))
        if self.layout != (tuple(slots), rows):
            self.slots[:rows].copy_(torch.tensor(slots + [self.cache.scratch] * (rows - active)))
            self.ids[active:rows].zero_()
            self.positions[active:rows].zero_()
            self.layout = (tuple(slots), rows)
        self.ids[:active].copy_(ids)
        self.positions[:active].copy_(positions)
        key = (rows, span, contiguous)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(*key)
            except RuntimeError as e:
                self.enabled = False
                print(f"generate: CUDA graphs off for this run (capture failed: {e}); decoding eagerly", file=sys.stderr, flush=True)
                return None
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out[:active]

    def _capture(self, rows: int, span: int, contiguous: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # A warm-up on a side stream first (the libraries' lazy setup and the compiled step's compile must not happen
        # inside a capture); it writes this step's keys and values, which the replay that follows writes again, the same.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(rows, span, contiguous)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(rows, span, contiguous)
        return graph, out
