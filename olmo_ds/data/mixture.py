"""How many instances of each source one epoch of a mixture holds, and which ones.

A mixture epoch holds n_s instances of source s, with n_s proportional to the source's weight. Its
size is the largest for which no source is read more than `max_epochs` times (default 1: no
repetition; >1 allows upsampling a small source, <1 caps a large one). So the weights are targets
and the caps are hard limits; `Mixture.report` says what each source really contributes.

Which n_s instances: each source has its own endless stream of seeded permutations of its
instances, and mixture epoch e takes positions [e * n_s, (e + 1) * n_s) of it. So over any number of
epochs a source's instances are shown equally often, give or take one: a downsampled source shows
new instances in each epoch until it has shown them all, an upsampled one each instance k or k + 1
times per epoch. All of it is a pure function of (seed,
sources, seq_len): every rank computes the same thing without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Distinct SeedSequence prefixes keep the per-source streams independent of the epoch shuffles.
SOURCE_STREAM = 1


@dataclass(frozen=True)
class MixtureSource:
    name: str
    weight: float
    max_epochs: float
    num_instances: int  # whole instances in the source (N_s)
    per_epoch: int  # instances it contributes to one mixture epoch (n_s)


class Mixture:
    """The composition of one mixture epoch; instance ids are global: source s, instance i -> base[s] + i."""

    def __init__(self, names: list[str], weights: list[float], max_epochs: list[float | None], num_instances: list[int]) -> None:
        caps = [1.0 if c is None else float(c) for c in max_epochs]  # DataConfig has checked they are > 0
        total_weight = float(sum(weights))
        shares = [w / total_weight for w in weights]
        # The largest epoch in which every source stays within its cap: n_s = share_s * size <= cap_s * N_s.
        size = min(cap * n / share for cap, n, share in zip(caps, num_instances, shares))
        per_epoch = [int(np.floor(share * size + 1e-9)) for share in shares]
        for name, n in zip(names, per_epoch):
            if n == 0:
                raise ValueError(
                    f"data source {name}: its weight gives it 0 instances per mixture epoch; "
                    "raise its weight or the max_epochs of the sources that limit the epoch"
                )
        self.sources = [MixtureSource(*args) for args in zip(names, weights, caps, num_instances, per_epoch)]
        self.base = np.concatenate([[0], np.cumsum(num_instances)]).astype(np.int64)
        self.epoch_size = int(sum(per_epoch))
        self.id_dtype = np.dtype(np.uint32) if self.base[-1] < 2**32 else np.dtype(np.int64)

    def source_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, instance index within that source) of each global instance id."""
        src = np.searchsorted(self.base, ids, side="right") - 1
        return src, ids - self.base[src]

    def epoch_ids(self, seed: int, epoch: int) -> np.ndarray:
        """The global ids of mixture epoch `epoch`, grouped by source (the caller shuffles them)."""
        out = np.empty(self.epoch_size, dtype=self.id_dtype)
        filled = 0
        for s, src in enumerate(self.sources):
            n, take = src.num_instances, src.per_epoch
            a, b = epoch * take, (epoch + 1) * take  # positions in the source's stream of permutations
            pos = a
            while pos < b:
                k, local = divmod(pos, n)
                piece = min(b - pos, n - local)
                dst = out[filled : filled + piece]
                if piece == n:
                    # A whole pass: which instances is all of them; the epoch shuffle orders them.
                    dst[:] = np.arange(n, dtype=self.id_dtype)
                else:
                    rng = np.random.Generator(np.random.PCG64([seed, SOURCE_STREAM, s, k]))
                    perm = np.arange(n, dtype=self.id_dtype)
                    rng.shuffle(perm)
                    dst[:] = perm[local : local + piece]
                dst += self.id_dtype.type(self.base[s])
                filled += piece
                pos += piece
        return out

    def report(self, seq_len: int, total_instances: int | None = None) -> list[dict]:
        """Per source: target and actual share, tokens and passes per mixture epoch (and per run, given its length)."""
        rows = []
        total_weight = sum(s.weight for s in self.sources)
        for s in self.sources:
            row = {
                "name": s.name,
                "target_share": s.weight / total_weight,
                "actual_share": s.per_epoch / self.epoch_size,
                "instances": s.num_instances,
                "tokens": s.num_instances * seq_len,
                "tokens_per_epoch": s.per_epoch * seq_len,
                "source_epochs_per_epoch": s.per_epoch / s.num_instances,
            }
            if total_instances is not None:
                used = total_instances * s.per_epoch / self.epoch_size
                row["run_tokens"] = int(used * seq_len)
                row["run_source_epochs"] = used / s.num_instances
            rows.append(row)
        return rows
