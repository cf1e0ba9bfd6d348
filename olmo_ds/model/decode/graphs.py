"""The decode step as CUDA graphs: on a GPU a step's hundreds of small kernels launch as one replay.

A decode step of a 1B model at batch 64 is a few milliseconds of GPU work behind ~700 kernel launches
that Python issues one by one, so eagerly the host, not the GPU, sets the pace. While every cache slot
holds a sequence (continuous batching keeps them full until the last prompts), a step has a fixed shape
`[slots, 1]` and reads `decode_span` positions per slot, one of a few multiples of `SPAN_BUCKET`; each
such shape is captured once into a CUDA graph over static input buffers (ids, positions) and replayed.
The graph runs the same kernels on the same cache tensors as the eager step, so it writes the same keys
and values and returns the same logits. Steps with free slots (the tail) run eagerly, over active
slots only, so finished sequences cost nothing. A capture that fails turns graphs off for the run, with
one line on stderr; decoding goes on eagerly.
"""

from __future__ import annotations

import sys

import torch

from olmo_ds.model.decode.cache import SlotCache
from olmo_ds.model.decode.forward import forward_logits
from olmo_ds.model.model import OLMo


class DecodeGraphs:
    """Graphs of the every-slot decode step of one `SlotCache`, one per span."""

    def __init__(self, model: OLMo, cache: SlotCache):
        self.model, self.cache = model, cache
        device = cache.keys[0].device
        self.ids = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(cache.slots, dtype=torch.long, device=device)
        self.slots = torch.arange(cache.slots, device=device)
        # Each graph keeps its own memory pool (a step's activations and logits, megabytes): graphs replay in any
        # order, so none may reuse another's memory.
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.enabled = True
        self.replays = 0

    def _step(self, span: int) -> torch.Tensor:
        self.cache.decode(self.slots, self.positions, span, contiguous=True)
        return forward_logits(self.model, self.ids, self.positions[:, None], self.cache, self.slots)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor | None:
        """Logits of the step feeding `ids` [slots, 1] at `positions` [slots], or None when graphs are off
        (the caller runs the step eagerly). The result is the graph's output buffer: read it before the next call."""
        if not self.enabled:
            return None
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        if span not in self.graphs:
            try:
                self.graphs[span] = self._capture(span)
            except RuntimeError as e:
                self.enabled = False
                print(f"generate: CUDA graphs off for this run (capture failed: {e}); decoding eagerly", file=sys.stderr, flush=True)
                return None
        graph, out = self.graphs[span]
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # A warm-up on a side stream first (the libraries' lazy setup must not happen inside a capture); it writes
        # this step's keys and values, which the replay that follows writes again, the same.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(span)
        return graph, out
