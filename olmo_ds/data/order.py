"""The global order of instances and the global batch-size schedule.

Training reads one endless stream of instance ids: mixture epoch 0 shuffled, then epoch 1 shuffled,
and so on, each shuffle a permutation from a PCG64 generator seeded by (seed, epoch). Global batch
k is the next `schedule.at(k)` ids of that stream, so the batches depend only on the data, the seed,
seq_len and the batch-size schedule, never on the world size, micro-batch size or prefetching. Every
rank computes the same permutation itself, so no shared filesystem is needed (OLMo's shared
`global_indices` file was a single point of failure for multi-node runs without one).
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_ds.data.mixture import Mixture

EPOCH_SHUFFLE = 0  # SeedSequence prefix of the epoch permutations (see mixture.SOURCE_STREAM)
# Epochs of at least this many instances (256 MiB of uint32 ids, ~275B tokens at seq 4096) are kept
# in a memory-mapped file shared by a node's ranks rather than in each rank's memory.
ORDER_CACHE_MIN_INSTANCES = 1 << 26
DEFAULT_ORDER_CACHE = Path.home() / ".cache" / "olmo_ds" / "order"


@dataclass(frozen=True)
class BatchSizeSchedule:
    """Global batch size (in instances) as a step function of the optimizer step.

    `points` are (first_step, global_batch_size), the first at step 0: e.g. OLMo 3's batch-size
    warmup ((0, 512), (2000, 1024), (6000, 2048)). Instances are still consumed exactly once: batch k
    starts where batch k - 1 ended, whatever their sizes.
    """

    points: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.points or self.points[0][0] != 0:
            raise ValueError(f"batch-size schedule {self.points}: the first entry must start at step 0")
        for (s0, _), (s1, _) in zip(self.points, self.points[1:]):
            if s1 <= s0:
                raise ValueError(f"batch-size schedule {self.points}: steps must increase, got {s0} then {s1}")
        for step, bs in self.points:
            if not isinstance(bs, int) or bs <= 0:
                raise ValueError(f"batch-size schedule: global batch size at step {step} must be a positive integer, got {bs!r}")

    @classmethod
    def parse(cls, spec) -> "BatchSizeSchedule":
        """From an int (constant), a {step: size} dict, or a list of [step, size] / {step:, global_batch_size:}."""
        if isinstance(spec, BatchSizeSchedule):
            return spec
        if isinstance(spec, int):
            return cls(((0, spec),))
        if isinstance(spec, dict):
            return cls(tuple(sorted((int(k), v) for k, v in spec.items())))
        points = []
        for entry in spec:
            if isinstance(entry, dict):
                unknown = set(entry) - {"step", "global_batch_size"}
                if unknown:
                    raise ValueError(f"batch-size schedule entry {entry}: unknown keys {sorted(unknown)} (expected step, global_batch_size)")
                points.append((int(entry["step"]), entry["global_batch_size"]))
            else:
                step, size = entry
                points.append((int(step), size))
        return cls(tuple(points))

    def to_list(self) -> list[list[int]]:
        return [list(p) for p in self.points]

    def at(self, step: int) -> int:
        i = bisect.bisect_right([p[0] for p in self.points], step) - 1
        return self.points[i][1]

    def instances_before(self, step: int) -> int:
        """Instances consumed by steps 0 .. step - 1."""
        total = 0
        for i, (start, size) in enumerate(self.points):
            end = self.points[i + 1][0] if i + 1 < len(self.points) else None
            if step <= start:
                break
            total += size * ((min(step, end) if end is not None else step) - start)
        return total


class GlobalOrder:
    """Instance ids in training order (see the module docstring); keeps the last two epochs at hand.

    An epoch of at least `cache_min_instances` ids is computed once per machine into `cache_dir` and
    memory-mapped from there: the ranks of a node then share one copy in the page cache instead of
    each holding gigabytes (1B instances = 4 GB of uint32). The file is node-local scratch, named by
    `key` (the data fingerprint and seq_len) and the seed, so no shared filesystem is involved; a lock
    file makes one rank compute it while the others wait.
    """

    def __init__(self, mixture: Mixture, seed: int, *, key: str = "", cache_dir: Path | None = None, cache_min_instances: int = ORDER_CACHE_MIN_INSTANCES) -> None:
        self.mixture = mixture
        self.seed = int(seed)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_ORDER_CACHE
        self.cache_min_instances = cache_min_instances
        self._key = hashlib.sha256(f"{key}|{self.seed}|{mixture.epoch_size}".encode()).hexdigest()[:20]
        self._epochs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the prefetch thread and the main thread both ask for epochs

    def epoch(self, e: int) -> np.ndarray:
        with self._lock:
            return self._epoch(e)

    def _compute(self, e: int) -> np.ndarray:
        ids = self.mixture.epoch_ids(self.seed, e)
        np.random.Generator(np.random.PCG64([self.seed, EPOCH_SHUFFLE, e])).shuffle(ids)
        return ids

    def cache_path(self, e: int) -> Path:
        return self.cache_dir / f"order-{self._key}-epoch{e:05d}.npy"

    def _cached(self, e: int) -> np.ndarray:
        path = self.cache_path(e)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                ids = np.load(path, mmap_mode="r")
                if ids.shape == (self.mixture.epoch_size,) and ids.dtype == self.mixture.id_dtype:
                    return ids
            ids = self._compute(e)
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
            with open(tmp, "wb") as f:
                np.save(f, ids)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return np.load(path, mmap_mode="r")

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            large = self.mixture.epoch_size >= self.cache_min_instances
            self._epochs[e] = self._cached(e) if large else self._compute(e)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[e]

    def ids(self, start: int, count: int) -> np.ndarray:
        """The ids at stream positions [start, start + count), across epoch boundaries."""
        size = self.mixture.epoch_size
        parts = []
        pos, end = start, start + count
        while pos < end:
            e, local = divmod(pos, size)
            take = min(end - pos, size - local)
            parts.append(self.epoch(e)[local : local + take])
            pos += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
