"""How a run's ranks divide the work: data parallel x sequence parallel (`parallel.sequence_parallel_size`).

    layout = ParallelLayout.of(cfg, rank=env.rank, world_size=env.world_size)   # a ConfigError if it cannot be
    sp = sequence_group(layout)                  # collective, after torch.distributed is up: this rank's SequenceParallel

Ranks [i N, (i + 1) N) form sequence group i (N = sequence_parallel_size): they hold one set of rows between them,
each 1/N of every row (`olmo_ds.model.sequence_parallel`), and read the rows of data-parallel rank i. Consecutive
ranks, so that on a node of 8 GPUs a group of up to 8 exchanges over NVLink, not the network.

DeepSpeed sees every rank as data parallel, and is told nothing else but the batch arithmetic
(`sequence_parallel_size` in its JSON, so that its train_batch_size counts rows, not rank-slices of rows): ZeRO-3
partitions the weights, gradients and optimizer state over all the ranks, and averages gradients over all of them,
which is what DeepSpeed's own Ulysses groups do (its sequence-data-parallel group is the world). The group is not
handed to DeepSpeed as an `mpu`: DeepSpeed would then name checkpoint files by sequence rank (`mp_rank_01`), tying a
checkpoint to its N, where here a checkpoint is laid out as a data-parallel one of the same world size, and a run
saved at one N resumes at any other (the data order is the data-parallel ranks', which do not depend on N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from olmo_ds.model.sequence_parallel import SequenceParallel
from olmo_ds.train.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place: `world_size` = `dp_size` x `sp_size`; rank = dp_rank x sp_size + sp_rank."""

    world_size: int
    sp_size: int
    rank: int

    @classmethod
    def of(cls, cfg: TrainConfig, *, rank: int, world_size: int) -> ParallelLayout:
        sp = cfg.parallel.sequence_parallel_size
        if world_size % sp:
            raise ConfigError(f"{cfg.source}: parallel.sequence_parallel_size {sp} does not divide the {world_size} ranks of this "
                              f"launch: the world is data-parallel x sequence-parallel ranks; launch a multiple of {sp}")
        return cls(world_size=world_size, sp_size=sp, rank=rank)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    def describe(self) -> str:
        if self.sp_size == 1:
            return f"{self.world_size} data-parallel ranks"
        return (f"{self.world_size} ranks = {self.dp_size} data-parallel x {self.sp_size} sequence-parallel "
                f"(each holds 1/{self.sp_size} of every row)")


def sequence_group(layout: ParallelLayout) -> SequenceParallel | None:
    """This rank's sequence group (None when sequence_parallel_size is 1). Collective: every rank makes every group,
    as torch.distributed.new_group requires."""
    if layout.sp_size == 1:
        return None
    mine = None
    for first in range(0, layout.world_size, layout.sp_size):
        group = dist.new_group(list(range(first, first + layout.sp_size)))
        if first == layout.dp_rank * layout.sp_size:
            mine = group
    return SequenceParallel.of(mine)


def local_rows(batch: dict[str, torch.Tensor], sp: SequenceParallel) -> dict[str, torch.Tensor]:
    """This rank's slice of every per-position tensor of the rows (shaped as `input_ids`: the tokens, the labels, an
    RL row's per-token log-probabilities and advantages); `doc_lens` and `positions` stay whole (the masks are the
    whole rows'), and so does anything not per position (`row_tokens`). Cut on the host, before the copy to the
    device, which then moves 1/N of the tokens."""
    shape = batch["input_ids"].shape
    return {k: v if k in ("doc_lens", "positions") or v.shape != shape else sp.local(v) for k, v in batch.items()}
