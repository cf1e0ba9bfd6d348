"""The reference pass of preference tuning: the frozen starting model's log-probability of every pair, once.

DPO and its kin compare the policy's log-probability of each reply with the starting model's (the reference). The
reference never changes, so it is computed once, before the first step, by the engine itself while it still holds
the starting weights: one no-grad pass over every pair of the training data (and of each validation source), each
data-parallel rank its share of the rows, the per-side sums gathered by global pair id (`compute_pair_logprobs`).
Training then holds one model's state, not two, and a step looks its pairs' reference up by id.

The result is stored beside the run, `RUN/reference/`: one `.npy` per array and `reference.json` with each file's
sha256, and what it was computed from (`ReferenceIdentity`: the training data's fingerprint, the starting
weights' fingerprint, seq_len, precision, `data.long_pairs`). Every file is written atomically (`olmo_ds.atomic`),
the JSON last, so a cache is complete or absent. `load_reference` verifies the checksums and the identity and
refuses another data set or starting model naming both; a resume loads it and never recomputes it
(`REFERENCE_PASSES` counts the passes this process ran, and the log says which way it went).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from olmo_ds.atomic import atomic_write_bytes, atomic_write_json
from olmo_ds.eval.preference import pair_sides
from olmo_ds.train.config import ConfigError

log = logging.getLogger("olmo_ds")

REFERENCE_DIR = "reference"
MANIFEST = "reference.json"
FORMAT_VERSION = 1

# Reference passes this process ran ("computed") and caches it verified and reused ("loaded").
REFERENCE_PASSES: collections.Counter = collections.Counter()


@dataclass(frozen=True)
class ReferenceIdentity:
    """What a reference cache was computed from; a run may use a cache only if every field matches."""

    data: str  # the training data's fingerprint (`DataLoader.fingerprint`: shards, sizes, checksums, tokenizer)
    model: str  # the starting weights' fingerprint (`olmo_ds.weights.weights_fingerprint`, as init_from records it)
    seq_len: int  # rows the pairs were packed into (positions and masks depend on nothing else; kept to be plain)
    precision: str  # the dtype the reference forward ran in
    long_pairs: str  # data.long_pairs: which pairs exist

    def differences(self, other: ReferenceIdentity) -> list[str]:
        return [f"{f.name}: {getattr(self, f.name)!r} (cache) vs {getattr(other, f.name)!r} (this run)"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass
class PairLogprobs:
    """Per global pair id: `logprob` float32 [N, 2] (chosen, rejected: the summed log-probability of the reply's
    labels; NaN for a pair the data left out, `data.long_pairs: drop`) and `tokens` int64 [N, 2] (labels per side)."""

    logprob: np.ndarray
    tokens: np.ndarray

    @property
    def num_pairs(self) -> int:
        return int(self.logprob.shape[0])

    @property
    def present(self) -> int:
        return int(np.isfinite(self.logprob[:, 0]).sum())

    def lookup(self, pair_ids: torch.Tensor, device=None) -> torch.Tensor:
        """float32 [..., 2]: the reference of each id in `pair_ids` (-1 entries give 0; they are padding)."""
        ids = pair_ids.cpu().numpy()
        if ids.size and ids.max() >= self.num_pairs:
            raise ConfigError(f"pair id {int(ids.max())} is beyond the reference's {self.num_pairs} pairs (another data set?)")
        out = np.where((ids >= 0)[..., None], self.logprob[np.maximum(ids, 0)], 0.0).astype(np.float32)
        if np.isnan(out).any():
            raise ConfigError("a batch holds a pair whose reference is missing: the data is not what the reference pass read")
        return torch.from_numpy(out).to(device if device is not None else pair_ids.device)


@dataclass
class ReferenceCache:
    """The reference of the training pairs (`train`) and of each validation source (`val`, by name)."""

    identity: ReferenceIdentity
    train: PairLogprobs
    val: dict[str, PairLogprobs] = dataclasses.field(default_factory=dict)
    stats: dict = dataclasses.field(default_factory=dict)  # the pass's seconds and tokens per second


def compute_pair_logprobs(model, batches: Iterable[dict], num_pairs: int, device) -> tuple[PairLogprobs, int]:
    """The per-side log-probability sums of `model` (no grad) over this rank's `batches` (loader-style dicts with
    `pair_ids`), gathered over the data-parallel ranks: every rank returns the same `PairLogprobs` of `num_pairs`
    pairs (ids as the batches number them), and the row tokens it forwarded.

    Collective when torch.distributed is initialised: every rank must pass equally many batches (the
    `validation_batches` contract). A pair seen twice is an error; a pair never seen stays NaN (dropped by the data)."""
    logprob = torch.zeros(num_pairs, 2, dtype=torch.float32, device=device)
    tokens = torch.zeros(num_pairs, 2, dtype=torch.int64, device=device)
    seen = torch.zeros(num_pairs, dtype=torch.int64, device=device)
    forwarded = 0
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(batch["input_ids"], labels=batch["labels"], doc_lens=batch["doc_lens"], positions=batch["positions"],
                        per_document=True)
            lp, n, ids = pair_sides(out.logprob, out.tokens, batch["pair_ids"])
            logprob.index_add_(0, ids, lp.float())
            tokens.index_add_(0, ids, n)
            seen.index_add_(0, ids, torch.ones_like(ids))
            forwarded += batch["input_ids"].numel()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for t in (logprob, tokens, seen):
            torch.distributed.all_reduce(t)
    if num_pairs and int(seen.max()) > 1:
        raise RuntimeError(f"the reference pass saw pair {int(seen.argmax())} {int(seen.max())} times; each pair belongs to one row")
    missing = seen == 0
    logprob[missing] = float("nan")
    tokens[missing] = -1
    return PairLogprobs(logprob.cpu().numpy(), tokens.cpu().numpy()), forwarded


def reference_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / REFERENCE_DIR


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def save_reference(directory: str | Path, cache: ReferenceCache) -> Path:
    """Write `cache` into `directory` (rank 0 only): the arrays first, then `reference.json` with their sha256, so
    a crash leaves no manifest for a partial cache. Refuses to overwrite an existing cache."""
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        raise ConfigError(f"{directory / MANIFEST} exists; a reference cache is never overwritten (remove the directory to recompute it)")
    directory.mkdir(parents=True, exist_ok=True)
    sets = {"train": cache.train, **{f"val/{name}": v for name, v in cache.val.items()}}
    files = {}
    for name, pairs in sets.items():
        stem = name.replace("/", "-")
        entry = {"pairs": pairs.num_pairs, "present": pairs.present}
        for field, array in (("logprob", pairs.logprob.astype(np.float32)), ("tokens", pairs.tokens.astype(np.int64))):
            data = _npy_bytes(array)
            atomic_write_bytes(directory / f"{stem}.{field}.npy", data)
            entry[field] = {"file": f"{stem}.{field}.npy", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        files[name] = entry
    atomic_write_json(directory / MANIFEST, {"format_version": FORMAT_VERSION, "identity": dataclasses.asdict(cache.identity),
                                             "sets": files, "stats": cache.stats})
    return directory


def reference_exists(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def load_reference(directory: str | Path, expected: ReferenceIdentity | None = None) -> ReferenceCache:
    """The cache in `directory`, every file checked against its sha256; with `expected`, refused (`ConfigError`
    naming both sides) unless it was computed from the same data, starting model, seq_len, precision and
    `data.long_pairs`."""
    directory = Path(directory)
    manifest_file = directory / MANIFEST
    if not manifest_file.is_file():
        raise ConfigError(f"{directory}: no reference cache ({MANIFEST} is missing)")
    try:
        manifest = json.loads(manifest_file.read_text())
        identity = ReferenceIdentity(**manifest["identity"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{manifest_file}: not a reference cache manifest ({type(e).__name__}: {e})") from None
    if expected is not None and (diff := identity.differences(expected)):
        raise ConfigError(
            f"{directory}: this reference cache was computed from other inputs than this run's: " + "; ".join(diff)
            + ". A reference is the starting model's log-probabilities of these pairs; it is never recomputed on resume. "
            "Start a new run dir for other data or another starting model (or remove the cache if this run has no checkpoint yet)")
    sets = {}
    for name, entry in manifest["sets"].items():
        arrays = {}
        for field in ("logprob", "tokens"):
            path = directory / entry[field]["file"]
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise ConfigError(f"{path}: missing from the reference cache ({manifest_file} lists it)") from None
            digest = hashlib.sha256(data).hexdigest()
            if digest != entry[field]["sha256"]:
                raise ConfigError(f"{path}: sha256 {digest} differs from {entry[field]['sha256']} in {manifest_file}; the cache is "
                                  f"damaged (remove {directory} before the run's first checkpoint to recompute it)")
            arrays[field] = np.load(io.BytesIO(data), allow_pickle=False)
        sets[name] = PairLogprobs(arrays["logprob"], arrays["tokens"])
    if "train" not in sets:
        raise ConfigError(f"{manifest_file}: no training set in the reference cache")
    val = {name.removeprefix("val/"): v for name, v in sets.items() if name.startswith("val/")}
    return ReferenceCache(identity, sets["train"], val, manifest.get("stats", {}))


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
