"""Batched log-likelihood scoring shared by perplexity and multiple choice, on one rank or many.

Both evaluations reduce to "run the model on fixed token rows and read the log-probability of given
target tokens". This module owns the parts that must be right once:

- Log-probabilities are taken in float32 from whatever dtype the model returns, a few positions at a
  time, so a 100k-entry vocabulary never needs a float32 copy of a whole batch of logits.
- Work is split across data-parallel ranks by whole batches, and the batches are formed before the
  split (they depend only on the data), so every row is computed with the same neighbours and the
  same padding whatever the world size: the gathered per-item scores are bitwise those of one rank.
- Every rank runs the same number of forward passes (a rank out of work repeats its last batch and
  drops the result), because under ZeRO-3 each forward gathers parameters collectively and a rank
  that stopped early would hang the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from olmo_ds.model import OLMo

# Positions per log-softmax chunk: 1024 x 100,352 float32 = 400 MB at most, whatever the batch.
LOGSOFTMAX_CHUNK = 1024

# How evaluation batches its forwards (`olmo_ds.eval.loglikelihood`, `olmo_ds.eval.perplexity`):
# `packed`, rows of one width in batches of one shape through the model's scoring forward, or `exact`,
# the earlier path (batches of one exact length, full logits, eager), kept as the reference.
BATCHING = ("packed", "exact")


def check_batching(batching: str) -> str:
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    return batching


def olmo_of(model):
    """Our OLMo behind `model` (itself, or a DeepSpeed engine's module), else None."""

    inner = getattr(model, "module", model)
    return inner if isinstance(inner, OLMo) else None


@dataclass(frozen=True)
class DistContext:
    """Which data-parallel rank this process is, of how many (1 and 0 when not distributed)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "DistContext":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"dp_rank {self.rank} is not in [0, dp_world={self.world})")

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (just [obj] on one rank)."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def logits_of(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Logits `[B, T, V]` from our OLMo (returns a tensor) or a transformers model (returns an output)."""
    out = model(input_ids, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.logits


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t] | logits[t]) in float32 for `[T, V]` logits and `[T]` targets (all valid ids)."""
    out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], LOGSOFTMAX_CHUNK):
        chunk = logits[start : start + LOGSOFTMAX_CHUNK].float()
        tgt = targets[start : start + LOGSOFTMAX_CHUNK]
        picked = chunk.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        out[start : start + LOGSOFTMAX_CHUNK] = picked - torch.logsumexp(chunk, dim=-1)
    return out


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, device) -> torch.Tensor:
    """Right-pad token rows into an int64 `[B, max_len]` tensor.

    Right padding never changes a causal model's outputs at the real positions, so no attention
    mask is needed and padded rows score exactly as they would alone.
    """
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def length_batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int | None = None) -> list[list[int]]:
    """Indices grouped into batches, longest rows first, each within `batch_tokens` padded tokens.

    Longest first so a batch too large for the device fails in the first step, not after an hour.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        full = (len(current) + 1) * width > batch_tokens or (max_batch_size is not None and len(current) >= max_batch_size)
        if current and full:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def run_split(num_batches: int, step: Callable[[int], object], ctx: DistContext) -> list:
    """Call `step(b)` for this rank's share of batches 0..num_batches-1; every rank gets all results.

    Rank r takes batches r, r + world, ...; all ranks make the same number of calls (see the module
    docstring). Returns the list of `step` results indexed by batch.
    """
    mine = list(range(ctx.rank, num_batches, ctx.world))
    rounds = -(-num_batches // ctx.world) if num_batches else 0
    results = {}
    for i in range(rounds):
        if i < len(mine):
            results[mine[i]] = step(mine[i])
        elif num_batches:
            step(num_batches - 1)  # keep collective forwards in lockstep; result unused
    gathered: dict = {}
    for part in ctx.all_gather(results):
        gathered.update(part)
    return [gathered[b] for b in range(num_batches)]
