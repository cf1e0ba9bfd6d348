"""Prove that a shard directory is what its metadata says, before a run spends GPU hours on it.

Per shard: the `.bin` size equals num_tokens × itemsize, the dtype suits the vocabulary, every id
is below the vocabulary size (the largest is reported as `vocab_max`), the document offsets start
at 0, increase, end at num_tokens, each document ends in EOS and holds no other EOS (an EOS-scanning
reader such as OLMo-core's document-aware datasets would otherwise see more documents than the
offsets record; allowed only where the manifest says `--match-special-tokens` made it so, and then
counted), and the sha256 matches. Per
directory: the manifest lists exactly the shards on disk, its totals are the sums over them, and
(given a tokenizer) its fingerprint, vocabulary size and EOS match the tokenizer's. A validation
split in `val/` is checked the same way. Each shard is read once, in blocks, so memory stays small
and shards can be checked in parallel.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from olmo_ds.data import shards

BLOCK_BYTES = 1 << 24


@dataclass
class ShardReport:
    name: str  # relative to the validated directory, e.g. "shard-00001.bin" or "val/shard-00000.bin"
    num_tokens: int = 0
    num_docs: int = 0
    vocab_max: int = -1
    docs_with_inner_eos: int = 0  # documents holding an EOS before their last token
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class Report:
    directory: str
    shards: list[ShardReport] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # directory-level: manifest, tokenizer, missing shards
    num_tokens: int = 0
    num_docs: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors and all(s.ok for s in self.shards)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for s, sd in zip(self.shards, d["shards"]):
            sd["ok"] = s.ok
        return d


def check_shard(directory: Path, bin_name: str, prefix: str = "", inner_eos_allowed: bool = False) -> ShardReport:
    """Every per-shard check; never raises for a bad shard, it reports. `inner_eos_allowed`: EOS ids
    inside documents are counted, not an error (shards made with --match-special-tokens)."""
    directory = Path(directory)
    report = ShardReport(prefix + bin_name)
    meta_file = (directory / bin_name).with_suffix(".json")
    if not meta_file.is_file():
        report.errors.append(f"missing metadata {meta_file.name}")
        if not (directory / bin_name).is_file():
            report.errors.append("missing .bin file")
        return report
    try:
        meta = shards.ShardMeta.load(meta_file)
    except (ValueError, TypeError) as e:
        report.errors.append(f"unreadable metadata: {e}")
        return report
    bin_file = directory / meta.bin  # beside it, or (in-place token files) an absolute path elsewhere
    if not bin_file.is_file():
        report.errors.append("missing .bin file" if bin_file.parent == directory else f"missing token file {bin_file}")
        return report
    report.num_tokens, report.num_docs = meta.num_tokens, meta.num_docs
    expected_dtype = shards.dtype_for_vocab(meta.vocab_size)
    if meta.dtype != expected_dtype.name:
        report.errors.append(f"dtype {meta.dtype} but vocab_size {meta.vocab_size} needs {expected_dtype.name}")
        return report
    dtype = np.dtype(meta.dtype).newbyteorder("<")
    size = bin_file.stat().st_size
    if size != meta.num_tokens * dtype.itemsize:
        report.errors.append(f"size {size} bytes != num_tokens {meta.num_tokens} x {dtype.itemsize} (truncated or corrupt)")
        return report

    digest = hashlib.sha256()
    vocab_max = -1
    eos_count = 0
    with open(bin_file, "rb") as f:
        while block := f.read(BLOCK_BYTES - BLOCK_BYTES % dtype.itemsize):
            digest.update(block)
            ids = np.frombuffer(block, dtype=dtype)
            if len(ids):
                vocab_max = max(vocab_max, int(ids.max()))
                eos_count += int(np.count_nonzero(ids == meta.eos_id))
    report.vocab_max = vocab_max
    if vocab_max >= meta.vocab_size:
        report.errors.append(f"token id {vocab_max} >= vocab_size {meta.vocab_size}")
    if vocab_max != meta.max_token_id:
        report.errors.append(f"max token id {vocab_max} != metadata max_token_id {meta.max_token_id}")
    if "sha256:" + digest.hexdigest() != meta.checksum:
        report.errors.append(f"checksum mismatch: sha256:{digest.hexdigest()} != metadata {meta.checksum}")

    offsets_file = directory / meta.offsets
    if not offsets_file.is_file():
        report.errors.append(f"missing offsets {meta.offsets}")
        return report
    try:
        offsets = shards.load_offsets(offsets_file)
    except ValueError as e:
        report.errors.append(f"unreadable offsets {meta.offsets}: {e}")
        return report
    if len(offsets) != meta.num_docs + 1:
        report.errors.append(f"{len(offsets)} offsets for {meta.num_docs} documents (expected num_docs + 1)")
    elif len(offsets) and (offsets[0] != 0 or offsets[-1] != meta.num_tokens):
        report.errors.append(f"offsets run {offsets[0]}..{offsets[-1]}, not 0..{meta.num_tokens}")
    elif np.any(np.diff(offsets) <= 0):
        report.errors.append(f"offsets not strictly increasing (first at document {int(np.argmax(np.diff(offsets) <= 0))})")
    elif meta.num_docs:
        tokens = shards.open_tokens(bin_file, meta)
        ends = tokens[np.asarray(offsets[1:]) - 1]
        bad = np.flatnonzero(ends != meta.eos_id)
        if len(bad):
            report.errors.append(f"{len(bad)} documents do not end in EOS {meta.eos_id} (first: document {int(bad[0])})")
        elif eos_count != meta.num_docs:
            _count_inner_eos(report, tokens, np.asarray(offsets), meta.eos_id, inner_eos_allowed)
    return report


def _count_inner_eos(report: ShardReport, tokens: np.ndarray, offsets: np.ndarray, eos_id: int, allowed: bool) -> None:
    """More EOS ids than documents: find which documents hold them (only run when that is so)."""
    is_end = np.zeros(len(tokens), dtype=bool)
    is_end[offsets[1:] - 1] = True
    inner = np.flatnonzero((np.asarray(tokens) == eos_id) & ~is_end)
    docs = np.unique(np.searchsorted(offsets, inner, side="right") - 1)
    report.docs_with_inner_eos = len(docs)
    if not allowed:
        report.errors.append(
            f"{len(docs)} documents hold EOS {eos_id} before their end (first: document {int(docs[0])}, token {int(inner[0])}): "
            "readers that split documents at EOS would disagree with the offsets; prepare again without --match-special-tokens"
        )


def _check(args) -> ShardReport:
    return check_shard(*args)


def validate_directory(directory: Path, tokenizer=None, workers: int = 1, prefix: str = "") -> Report:
    """Validate a shard directory (and its `val/` split); `tokenizer` is a loaded `Tokenizer` or None."""
    directory = Path(directory)
    report = Report(str(directory))
    if not directory.is_dir():
        report.errors.append(f"{directory}: not a directory")
        return report
    on_disk = [p.name for p in shards.list_shards(directory)]
    try:
        manifest = shards.Manifest.load(directory)
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as e:
        report.errors.append(f"{prefix}{shards.MANIFEST}: {e}")
        manifest = None
    listed = manifest.shards if manifest else on_disk
    for name in sorted(set(on_disk) - set(listed)):
        report.errors.append(f"{prefix}{name}: on disk but not in {shards.MANIFEST}")
    inner_eos_allowed = bool(manifest and manifest.extra.get("arguments", {}).get("match_special_tokens"))
    tasks = [(directory, name, prefix, inner_eos_allowed) for name in listed]
    if workers > 1 and len(tasks) > 1:
        with mp.get_context("fork").Pool(min(workers, len(tasks))) as pool:
            report.shards = pool.map(_check, tasks)
    else:
        report.shards = [_check(t) for t in tasks]
    for s in report.shards:
        report.num_tokens += s.num_tokens
        report.num_docs += s.num_docs
    if manifest is not None:
        _check_manifest(report, manifest, directory, tokenizer, prefix)
        val = manifest.extra.get("val")
        if val:
            sub = validate_directory(directory / val["dir"], tokenizer, workers, prefix=f"{prefix}{val['dir']}/")
            report.shards += sub.shards
            report.errors += sub.errors
            report.num_tokens += sub.num_tokens
            report.num_docs += sub.num_docs
            if (sub.num_docs, sub.num_tokens) != (val["num_docs"], val["num_tokens"]):
                report.errors.append(f"{prefix}{shards.MANIFEST}: val split is {val['num_docs']} docs / {val['num_tokens']} tokens, but {val['dir']}/ holds {sub.num_docs} / {sub.num_tokens}")
    return report


def _check_manifest(report: Report, manifest: shards.Manifest, directory: Path, tokenizer, prefix: str) -> None:
    where = f"{prefix}{shards.MANIFEST}"
    if manifest.num_tokens != report.num_tokens or manifest.num_docs != report.num_docs:
        report.errors.append(f"{where}: totals {manifest.num_docs} docs / {manifest.num_tokens} tokens != sum over shards {report.num_docs} / {report.num_tokens}")
    for s in report.shards:
        meta_file = (directory / Path(s.name).name).with_suffix(".json")
        if not meta_file.is_file():
            continue
        try:
            meta = shards.ShardMeta.load(meta_file)
        except (ValueError, TypeError):
            continue
        for key in ("dtype", "vocab_size", "eos_id"):
            if getattr(meta, key) != getattr(manifest, key):
                s.errors.append(f"{key} {getattr(meta, key)} != manifest's {getattr(manifest, key)}")
    if tokenizer is not None:
        if manifest.tokenizer_fingerprint != tokenizer.fingerprint:
            report.errors.append(f"{where}: tokenizer fingerprint {manifest.tokenizer_fingerprint} != {tokenizer.fingerprint} of {tokenizer.path} (shards made with another tokenizer)")
        if manifest.vocab_size != tokenizer.vocab_size:
            report.errors.append(f"{where}: vocab_size {manifest.vocab_size} != the tokenizer's {tokenizer.vocab_size}")
        if manifest.eos_id != tokenizer.eos_id:
            report.errors.append(f"{where}: eos_id {manifest.eos_id} != the tokenizer's {tokenizer.eos_id}")


def format_report(report: Report) -> str:
    """One line per shard, the directory-level problems, then a totals line."""
    lines = []
    for s in report.shards:
        if s.ok:
            inner = f", {s.docs_with_inner_eos:,} documents with EOS inside (--match-special-tokens)" if s.docs_with_inner_eos else ""
            lines.append(f"{s.name}: OK ({s.num_tokens:,} tokens, vocab_max={s.vocab_max}{inner})")
        else:
            lines.append(f"{s.name}: FAIL: {'; '.join(s.errors)}")
    lines += [f"error: {e}" for e in report.errors]
    bad = sum(not s.ok for s in report.shards)
    status = "OK" if report.ok else f"FAIL ({bad} bad shards, {len(report.errors)} other problems)"
    lines.append(f"total: {status}: {len(report.shards)} shards, {report.num_docs:,} docs, {report.num_tokens:,} tokens")
    return "\n".join(lines)
