"""The reference pass of preference tuning: the frozen starting model's log-probability of every pair, once.

DPO and its kin compare the policy's log-probability of each reply with the starting model's (the reference). The
reference never changes, so it is computed once, before the first step, by the engine itself while it still holds
the starting weights: one no-grad pass over every pair of the training data (and of each validation source), each
data-parallel rank its share of the rows, the per-side sums gathered by global pair id
(`olmo_ds.eval.preference.compute_pair_logprobs`). Training then holds one model's state, not two, and a step looks
its pairs' reference up by id. The result is stored beside the run (`olmo_ds.checkpoint.reference`: RUN/reference/,
checksummed, with what it was computed from) and a resume loads it, never recomputes it; `REFERENCE_PASSES` counts
the passes this process ran and the caches it reused, and the log says which way it went.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from olmo_ds.checkpoint.reference import PairLogprobs, ReferenceCache, ReferenceIdentity
from olmo_ds.eval.preference import compute_pair_logprobs

log = logging.getLogger("olmo_ds")

# Reference passes this process ran ("computed") and caches it verified and reused ("loaded").
REFERENCE_PASSES: collections.Counter = collections.Counter()


def run_reference_pass(model, identity: ReferenceIdentity, train: list[tuple[Iterable[dict], int, int]],
                       val: dict[str, tuple[Iterable[dict], int]], device) -> ReferenceCache:
    """The whole pass (collective): `train` as (batches, pairs of the source, first global id) per source, `val` as
    name -> (batches, pairs). Returns the cache every rank holds; the caller saves it (rank 0)."""
    REFERENCE_PASSES["computed"] += 1
    t0 = time.perf_counter()
    total = sum(n for _, n, _ in train)
    logprob = np.full((total, 2), np.nan, dtype=np.float32)
    tokens = np.full((total, 2), -1, dtype=np.int64)
    forwarded = 0
    for batches, n, first in train:
        part, rows = compute_pair_logprobs(model, batches, n, device)
        logprob[first:first + n], tokens[first:first + n] = part.logprob, part.tokens
        forwarded += rows
    val_sets = {}
    for name, (batches, n) in val.items():
        val_sets[name], rows = compute_pair_logprobs(model, batches, n, device)
        forwarded += rows
    counted = torch.tensor([float(forwarded)], device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counted)
    seconds = time.perf_counter() - t0
    stats = {"seconds": seconds, "row_tokens": int(counted.item()), "tokens_per_second": counted.item() / max(seconds, 1e-9)}
    cache = ReferenceCache(identity, PairLogprobs(logprob, tokens), val_sets, stats)
    log.info("reference pass: computed %d of %d training pairs%s in %.1fs (%s row tokens/s over all ranks)",
             cache.train.present, total, "".join(f", {v.present} of {name}" for name, v in val_sets.items()), seconds,
             f"{stats['tokens_per_second']:,.0f}")
    return cache
