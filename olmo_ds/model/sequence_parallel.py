"""Ulysses sequence parallelism: the ranks of a sequence group each hold 1/N of every row, attention sees whole rows.

Outside attention every operation of the model is per token (the embedding, the norms, the projections, RoPE at
each token's own position, the MLP, the head and its loss), so each rank of the group runs them on its own
contiguous slice of every row: rank r holds positions [r T/N, (r + 1) T/N). Attention is where tokens meet. There
an all-to-all over the group trades the split (DeepSpeed's Ulysses exchange, `deepspeed::dim_zero_all_to_all`: one
`all_to_all_single` along dimension 0, with a declared backward, so autograd and torch.compile both see through
it): q, k and v go from [B, T/N, H, D] (this rank's tokens, every head) to [B, T, H/N, D] (every token, this rank's
heads); the run's attention then runs exactly as on one rank, over whole rows, with the same kernel, the same
causal, document and sliding-window masks and the same RoPE positions; a second exchange brings its output back to
[B, T/N, H, D] for the output projection. Per layer that is four all-to-alls of 1/N of the activations each way.

Grouped-query heads: rank r computes q heads [r H/N, (r + 1) H/N). When N divides H_kv the kv heads split the same
way and each rank receives exactly the kv heads its q heads use. When H_kv divides N instead, every kv head is
repeated N / H_kv times before the exchange, so each rank receives the one kv head its q heads share. Any other
H_kv, an H not divisible by N, or a row length not divisible by N cannot be split so and is refused before a run
starts (`sequence_parallel_problems`).

The process group is made by the trainer (`olmo_ds.train.parallel`) and passed to the model's forward as a
`SequenceParallel`; a forward without one (evaluation, generation, one rank) is the model as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sequence_parallel_problems(size: int, *, n_heads: int, n_kv_heads: int, seq_len: int) -> list[str]:
    """Why rows of `seq_len` tokens of a model with these heads cannot be spread over `size` ranks (empty: they can)."""
    if size == 1:
        return []
    problems = []
    if n_heads % size:
        problems.append(f"the model's {n_heads} attention heads (model.n_heads) do not divide over {size} ranks: "
                        f"each rank of a sequence group attends with n_heads / sequence_parallel_size heads")
    if n_kv_heads % size and size % n_kv_heads:
        problems.append(f"the model's {n_kv_heads} key/value heads (model.n_kv_heads) neither divide over {size} ranks nor "
                        f"divide {size} (then each rank takes one kv head, repeated): grouped-query attention cannot be split so")
    if seq_len % size:
        problems.append(f"batch.seq_len {seq_len} is not a multiple of {size}: each rank holds seq_len / sequence_parallel_size "
                        f"tokens of every row")
    return problems


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence group: `size` ranks that hold one row between them, this one at `rank` (its slice)."""

    group: object  # torch.distributed ProcessGroup
    size: int
    rank: int
    name: str  # the group's name, under which DeepSpeed's exchange finds it (also inside compiled code)

    @classmethod
    def of(cls, group) -> SequenceParallel:
        """The group, registered with DeepSpeed's exchange (outside any compiled region, as it must be)."""
        from deepspeed.sequence.layer import register_all_to_all_group

        name = register_all_to_all_group(group)
        return cls(group=group, size=torch.distributed.get_world_size(group), rank=torch.distributed.get_rank(group), name=name)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a whole-row tensor along `dim` (the sequence)."""
        length = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * length, length)


def _exchange(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """DeepSpeed's Ulysses all-to-all: block i of dimension 0 goes to rank i, block j received comes from rank j."""
    return torch.ops.deepspeed.dim_zero_all_to_all(x.contiguous(), group_name)


def gather_sequence(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """[B, T/N, H, D] (this rank's tokens, all heads) -> [B, T, H/N, D] (all tokens, this rank's heads)."""
    b, t, h, d = x.shape
    parts = x.view(b, t, size, h // size, d).permute(2, 0, 1, 3, 4)  # [N (destination rank), B, T/N, H/N, D]
    received = _exchange(parts, group_name)  # [N (source rank: its tokens), B, T/N, H/N, D]
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * t, h // size, d)


def scatter_sequence(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """[B, T, H/N, D] (all tokens, this rank's heads) -> [B, T/N, H, D] (this rank's tokens, all heads)."""
    b, full, h, d = x.shape
    t = full // size
    parts = x.view(b, size, t, h, d).permute(1, 0, 2, 3, 4)  # [N (destination rank: its tokens), B, T/N, H/N, D]
    received = _exchange(parts, group_name)  # [N (source rank: its heads), B, T/N, H/N, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, t, size * h, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, size: int, attention) -> torch.Tensor:
    """`attention(q, k, v)` over whole rows, from and back to this rank's slice of them. q [B, T/N, H, D], k and v
    [B, T/N, H_kv, D]; `attention` takes [B, T, H/N, D] and [B, T, H_kv/N or 1, D] and returns [B, T, H/N, D]."""
    n_kv = k.shape[2]
    if size > n_kv:  # each rank's q heads share one kv head: repeat them so that every rank receives its own
        k, v = k.repeat_interleave(size // n_kv, dim=2), v.repeat_interleave(size // n_kv, dim=2)
    q, k, v = (gather_sequence(x, group_name, size) for x in (q, k, v))
    return scatter_sequence(attention(q, k, v), group_name, size)
