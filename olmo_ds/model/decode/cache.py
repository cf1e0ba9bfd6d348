"""The KV cache of batched generation: a fixed number of sequence slots, each with its own length.

Full-attention layers keep every position of a slot, `[slots, kv_heads, max_len, head_dim]`; OLMo 3's
sliding-window layers keep only the window, a ring buffer `[slots, kv_heads, window, head_dim]` where
position p lives at p % window (a query at p sees p - window < j <= p, exactly the ring's contents once p
is written). The cache is allocated once, so decoding never grows or copies it, and a slot freed by a
finished sequence is refilled by the next prompt (continuous batching, `olmo_ds.model.decode.engine`).

The cache owns attention (`attend`, called by `olmo_ds.model.model.Attention` for the layer's new q, k, v):
- a prefill is one row of several whole prompts laid end to end (ragged, no padding); each prompt's
  queries attend causally within that prompt only (no compute crosses prompts), and its keys and values (a
  sliding layer: the last `window` of them) go into its slot. On a GPU in bf16/fp16 the whole row is one
  variable-length flash attention forward (`varlen_attention`: the prompts' boundaries as cumulative lengths,
  sliding windows as the kernel's window, GQA native) and a layer's cache writes are one indexed copy for the
  whole wave. Per-prompt SDPA calls are a new shape per prompt length, and on Hopper SDPA's cuDNN backend builds
  an execution plan per new shape (issue #59 measured seconds per wave of new lengths; this is its likely cause);
  the flash kernel has no such plan. Elsewhere (CPU, fp32, a flash kernel that fails on its first call) each prompt is one SDPA call,
  never cuDNN's on a GPU;
- a decode step is one new token for each of `A` slots, `[A, 1]`: its key and value are written at the
  slot's length, and attention reads that slot's first `length + 1` positions (or ring entries), through the
  kernel `olmo_ds.model.decode.attention` chooses (`triton`: each slot's own length straight from the cache;
  `sdpa`: a shared span behind a mask). On a GPU a step's rows are padded to a bucket (`row_bucket`), so a few
  shapes serve any number of active sequences (`olmo_ds.model.decode.graphs`): a padding row is slot
  `scratch`, an extra slot no sequence ever holds, at position 0, so its writes land where nothing reads them.

**Batch-invariant on CPU.** There a sample's numbers do not depend on which other sequences share its forwards
(RL's promise that 1 rank and 2 ranks draw the same samples: each rank decodes another mix of them). Two things
would make them depend on it, both measured on this project's CPU build of torch (MKL/oneDNN): a matmul of M rows
takes another kernel for small M (M = 1-3, and 5-7, 9-11 with 2 threads: other rounding for the same row), and
SDPA's CPU kernels round a row differently with another batch size or span. So on CPU (`SlotCache.invariant`) every
forward's rows are padded to a multiple of `ROW_MULTIPLE` (the engine repeats a row; a padded prefill position is
attended by nothing and writes nothing), and a decode step's attention runs per slot over exactly that slot's own
entries. On a GPU the shared-span and split-K kernels, CUDA graphs, compiled steps and bf16 keep their speed and
the promise stops there: a sample's tokens can depend on its batch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from olmo_ds.model.config import ModelConfig
from olmo_ds.model.decode.attention import choose, triton_decode

GIB = 1024 ** 3
# Without a GPU the cache's memory is bounded by this budget (bytes) unless the caller gives one.
DEFAULT_CPU_BUDGET = 4 * GIB
# Of a GPU's free memory, the share the cache may take (the rest: activations of a prefill, logits).
GPU_SHARE = 0.8
# A decode step's attention reads each slot's first `span` positions, span rounded up to a multiple of this:
# a few shapes only (each a CUDA graph, `olmo_ds.model.decode.graphs`), at most this many masked positions read.
SPAN_BUCKET = 256
# On CPU (`SlotCache.invariant`) every forward's rows are padded to a multiple of this (module docstring): every
# multiple of 4 rows took the same matmul kernel for a row as 700 rows did, with 1 or 2 threads.
ROW_MULTIPLE = 8


def row_bucket(rows: int, slots: int) -> int:
    """The rows a GPU decode step of `rows` active sequences runs: the next power of two, at most `slots` (a handful
    of shapes, each a CUDA graph; decoding is bound by the weights' bytes, so a padded row costs little)."""
    return min(1 << max(0, rows - 1).bit_length(), slots)


def padded_rows(rows: int, invariant: bool) -> int:
    """The rows a forward of `rows` rows runs (module docstring: batch-invariant on CPU)."""
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE if invariant else rows


def decode_span(longest: int, max_len: int) -> int:
    """The positions a decode step reads when its longest sequence holds `longest` (the new token included)."""
    return min(-(-longest // SPAN_BUCKET) * SPAN_BUCKET, max_len)


def layer_lengths(cfg: ModelConfig, max_len: int) -> list[int]:
    """Cached positions per layer for sequences of up to `max_len` tokens: max_len, or a sliding layer's window."""
    return [min(cfg.sliding_window, max_len) if cfg.layer_is_sliding(i) else max_len for i in range(cfg.n_layers)]


def bytes_per_sequence(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Cache bytes of one sequence slot: keys and values of every layer's cached positions."""
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_position * sum(layer_lengths(cfg, max_len))


def cache_budget(device: torch.device, budget: int | None = None) -> tuple[int, str]:
    """(bytes the cache may take, where that figure comes from)."""
    if budget is not None:
        return budget, "the given cache budget"
    if device.type == "cuda":
        # Free on the device, and what PyTorch's caching allocator holds without using (a training step's activations,
        # freed but kept reserved): the cache's allocation takes that first
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free * GPU_SHARE), f"{GPU_SHARE:.0%} of the GPU's free memory, with what PyTorch holds unused"
    return DEFAULT_CPU_BUDGET, "the default CPU cache budget"


def sequences_that_fit(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device, budget: int | None = None) -> int:
    """How many sequences of up to `max_len` tokens the cache budget holds (evaluation sizes its batches by it)."""
    return cache_budget(device, budget)[0] // bytes_per_sequence(cfg, max_len, dtype)


def check_fits(cfg: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
               budget: int | None = None) -> int:
    """Bytes per sequence; a ValueError saying how many sequences would fit when `slots` do not."""
    per_seq = bytes_per_sequence(cfg, max_len, dtype)
    available, source = cache_budget(device, budget)
    if slots * per_seq > available:
        fit = available // per_seq
        raise ValueError(f"a batch of {slots} sequences of up to {max_len} tokens needs a {slots * per_seq / GIB:.2f} GiB KV cache "
                         f"({per_seq / 2**20:.1f} MiB per sequence) but {available / GIB:.2f} GiB is available ({source}): "
                         + (f"at most {fit} sequences fit; lower the batch size to {fit}" if fit else
                            "not even one sequence fits; shorten the prompts or max_new_tokens, or raise the budget"))
    return per_seq


@dataclass
class _Prefill:
    slots: list[int]
    lengths: list[int]
    width: int  # positions in the row: the prompts' total, or more when padded (`padded_rows`)
    index: dict = field(default_factory=dict)  # the wave's device index tensors (`SlotCache._wave`), built once, not per layer


@dataclass
class _Decode:
    slots: torch.Tensor  # int64 [A], on the cache's device
    positions: torch.Tensor  # int64 [A]: the new token's position = the slot's cached length
    contiguous: bool  # slots are 0..A-1: the cache is read through views, not gathered
    span: int  # positions read per slot (`decode_span`); a ring reads min(span, its size)
    masks: dict = field(default_factory=dict)  # span -> [A, 1, 1, span] bool, built once per step, not per layer
    lengths: dict = field(default_factory=dict)  # ring size (None: full) -> int32 [A] entries each slot reads
    host: list[tuple[int, int]] = field(default_factory=list)  # (slot, position) per row, read on the host (invariant)


def write_decode(keys, values, slots, positions, ring: int | None, k, v) -> None:
    """A decode step's new keys and values `k`, `v` [A, 1, Hkv, D] into a layer's `keys`/`values` at each row's slot
    and position (a ring layer: position % ring). Eager in `attend`; traced into the compiled step's graph there."""
    where = positions % ring if ring else positions
    keys[slots, :, where] = k[:, 0]
    values[slots, :, where] = v[:, 0]


class SlotCache:
    """Per-slot keys and values (see the module docstring). `prefill(...)` or `decode(...)` says what the
    next forward holds; the model's attention layers then call `attend` once each."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype, attention: str = "auto", scratch: bool = False):
        self.cfg, self.slots, self.max_len = cfg, slots, max_len
        self.kernel = choose(torch.device(device), attention)
        self.invariant = torch.device(device).type == "cpu"  # batch-invariant numbers (module docstring)
        self._kernel_ran = False
        # `scratch`: one slot more, which no sequence holds: the padding rows of bucketed steps write there (`row_bucket`)
        self.scratch = slots if scratch else None
        # The variable-length flash prefill: None until its first call tells whether it runs here, then True or False
        self.varlen: bool | None = None if torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16) else False
        self.windows = [cfg.sliding_window if cfg.layer_is_sliding(i) else None for i in range(cfg.n_layers)]
        lengths = layer_lengths(cfg, max_len)
        shape = lambda n: (slots + int(scratch), cfg.n_kv_heads, n, cfg.head_dim)  # noqa: E731
        self.keys = [torch.zeros(shape(n), device=device, dtype=dtype) for n in lengths]
        self.values = [torch.zeros(shape(n), device=device, dtype=dtype) for n in lengths]
        self._step: _Prefill | _Decode | None = None

    def prefill(self, slots: list[int], lengths: list[int], width: int | None = None) -> None:
        """The next forward is one row of these whole prompts, in this order, each filling its slot from position 0;
        `width`: the row's positions when padded past the prompts (`padded_rows`)."""
        self._step = _Prefill(slots, lengths, width or sum(lengths))

    def decode(self, slots: torch.Tensor, positions: torch.Tensor, span: int, contiguous: bool,
               host: list[tuple[int, int]] | None = None) -> None:
        """The next forward is `[len(slots), 1]`: one token per slot (int64 tensors on the cache's device), at its
        position (the slot's cached length); `span`: `decode_span` of the longest; `contiguous`: slots are 0..A-1.
        `host`: the same (slot, position) pairs as Python ints, which the batch-invariant path needs."""
        self._step = _Decode(slots, positions, contiguous, span, host=host or [])

    def attend(self, layer: int, q, k, v, window: int | None, scale: float, written: bool = False) -> torch.Tensor:
        """The layer's attention output for the forward `prefill`/`decode` announced, after writing its new keys and
        values `k`, `v` into the cache; `written`: a decode step's writer already did (`decode_writes`)."""
        if isinstance(self._step, _Prefill):
            return self._attend_prefill(layer, q, k, v, window, scale)
        return self._attend_decode(layer, q, k, v, scale, written)

    def decode_writes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
        """Where a decode step's new keys and values go, for a writer of its own (the compiled step writes them from
        the kernel that makes them): the layer's keys and values, each row's slot and position, and its ring size
        (None: a full layer; a ring layer writes position % ring). Then `attend(..., written=True)`."""
        keys = self.keys[layer]
        return keys, self.values[layer], self._step.slots, self._step.positions, keys.shape[2] if self.windows[layer] is not None else None

    def _attend_prefill(self, layer, q, k, v, window, scale) -> torch.Tensor:
        if self.varlen is not False and q.shape[0] == 1:
            try:
                out = self._attend_wave(layer, q, k, v, window, scale)
                self.varlen = True
                return out
            except Exception as e:  # noqa: BLE001 - a kernel missing from this build, or one that refuses these shapes
                if self.varlen:
                    raise
                self.varlen = False  # its first call failed before writing anything: the per-prompt path does it all
                print(f"generate: the variable-length flash prefill failed ({type(e).__name__}: {e}); prefilling a prompt "
                      f"at a time", file=sys.stderr, flush=True)
        if q.is_cuda:  # never cuDNN: it builds a plan per prompt length (module docstring)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                return self._attend_prompts(layer, q, k, v, window, scale)
        return self._attend_prompts(layer, q, k, v, window, scale)

    def _wave(self, device) -> dict:
        """The prefill's index tensors, built on the first layer and shared by the others: cumulative prompt lengths
        (int32, the flash kernel's), each token's slot and position, and per ring size the tokens a ring keeps."""
        step = self._step
        if not step.index:
            lengths = torch.tensor(step.lengths)
            slots = torch.repeat_interleave(torch.tensor(step.slots), lengths)
            starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
            positions = torch.arange(int(lengths.sum())) - starts
            ends = torch.repeat_interleave(lengths, lengths)
            step.index.update(cu=torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).to(device),
                              longest=max(step.lengths), slots=slots.to(device), positions=positions.to(device))
            for ring in {t.shape[2] for t, w in zip(self.keys, self.windows) if w is not None}:
                kept = (positions >= ends - ring).nonzero()[:, 0]  # the last `ring` positions of each prompt
                step.index[ring] = (kept.to(device), slots[kept].to(device), (positions[kept] % ring).to(device))
        return step.index

    def _attend_wave(self, layer, q, k, v, window, scale) -> torch.Tensor:
        """The whole prefill row as one variable-length attention forward, and its cache writes as one indexed copy."""
        index = self._wave(q.device)
        q0, k0, v0 = q[0], k[0], v[0]  # [N, H, D]: the row's tokens, prompts laid end to end
        out = varlen_attention(q0, k0, v0, index["cu"], index["longest"], window, scale)
        keys, values = self.keys[layer], self.values[layer]
        if window is None:
            keys[index["slots"], :, index["positions"]] = k0
            values[index["slots"], :, index["positions"]] = v0
        else:  # a ring keeps each prompt's last `ring` positions, at p % ring
            kept, slots, where = index[keys.shape[2]]
            keys[slots, :, where] = k0.index_select(0, kept)
            values[slots, :, where] = v0.index_select(0, kept)
        return out[None]

    def _attend_prompts(self, layer, q, k, v, window, scale) -> torch.Tensor:
        """One SDPA call per prompt (CPU, where it keeps a sample's numbers independent of its wave; fp32 on a GPU)."""
        step, outs, start = self._step, [], 0
        keys, values = self.keys[layer], self.values[layer]
        gqa = q.shape[2] != k.shape[2]
        for slot, n in zip(step.slots, step.lengths):
            qs, ks, vs = (t[:, start:start + n].transpose(1, 2) for t in (q, k, v))
            if window is None or n <= window:
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                pos = torch.arange(n, device=q.device)
                allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa)
            outs.append(out.transpose(1, 2))
            if window is None:
                keys[slot, :, :n] = ks[0]
                values[slot, :, :n] = vs[0]
            else:  # the last `ring` positions, each at its place p % ring
                ring = keys.shape[2]
                kept = torch.arange(max(0, n - ring), n, device=q.device)
                keys[slot][:, kept % ring] = ks[0][:, kept]
                values[slot][:, kept % ring] = vs[0][:, kept]
            start += n
        if step.width > start:  # padding positions (`padded_rows`): attended by nothing, written nowhere
            outs.append(q.new_zeros(q.shape[0], step.width - start, *q.shape[2:]))
        return torch.cat(outs, dim=1)

    def _attend_decode(self, layer, q, k, v, scale, written: bool) -> torch.Tensor:
        step = self._step
        keys, values = self.keys[layer], self.values[layer]
        ring = keys.shape[2] if self.windows[layer] is not None else None
        if not written:
            write_decode(keys, values, step.slots, step.positions, ring, k, v)
        span = min(step.span, keys.shape[2])
        if self.invariant:
            return self._attend_each(q, keys, values, ring, scale, gqa=q.shape[2] != k.shape[2])
        if self.kernel == "triton":
            if ring not in step.lengths:
                lengths = step.positions + 1
                step.lengths[ring] = (lengths.clamp(max=ring) if ring else lengths).to(torch.int32)
            try:
                out = triton_decode(q[:, 0], keys, values, step.slots, step.lengths[ring], scale, span)[:, None]
                self._kernel_ran = True
                return out
            except Exception as e:  # noqa: BLE001 - a kernel that fails to build (Triton's errors are of many kinds)
                if self._kernel_ran:
                    raise
                self.kernel = "sdpa"  # its first call failed: nothing was written by it; SDPA reads the same entries
                print(f"generate: the triton decode kernel failed ({type(e).__name__}: {e}); decoding with SDPA",
                      file=sys.stderr, flush=True)
        if step.contiguous:
            keys, values = keys[:len(step.slots), :, :span], values[:len(step.slots), :, :span]
        else:
            keys, values = keys[:, :, :span].index_select(0, step.slots), values[:, :, :span].index_select(0, step.slots)
        if span not in step.masks:  # a slot's entries 0..position are written (a ring's all, once position >= ring)
            step.masks[span] = (torch.arange(span, device=q.device)[None, :] <= step.positions[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=step.masks[span], scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    def _attend_each(self, q, keys, values, ring: int | None, scale: float, gqa: bool) -> torch.Tensor:
        """Each row's attention over exactly its slot's entries (0..position, or the whole ring once full), one
        SDPA call a row: its numbers depend on nothing else in the batch (module docstring)."""
        out = torch.empty_like(q)
        for a, (slot, position) in enumerate(self._step.host):
            n = min(position + 1, ring) if ring else position + 1
            out[a] = F.scaled_dot_product_attention(q[a:a + 1].transpose(1, 2), keys[slot:slot + 1, :, :n], values[slot:slot + 1, :, :n],
                                                    scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
        return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, window: int | None,
                     scale: float) -> torch.Tensor:
    """Causal attention of sequences laid end to end: q [N, H, D], k and v [N, H_kv, D] (GQA: H_kv divides H), sequence
    i its tokens cu[i]..cu[i+1] (int32 cumulative lengths), `longest` the longest; `window`: a query at p sees
    p - window < j <= p. PyTorch's flash attention forward (the FlashAttention-2 kernels SDPA's flash backend runs, here
    in their variable-length form, which `torch.nn.attention.varlen` wraps in newer releases): CUDA, fp16/bf16."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale,
                                                  window_size_left=window - 1 if window is not None else -1,
                                                  window_size_right=0 if window is not None else -1)
    return out[0]
