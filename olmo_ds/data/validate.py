"""Prove that a shard directory is what its metadata says, before a run spends GPU hours on it.

Per shard: the `.bin` size equals num_tokens × itemsize, the dtype suits the vocabulary, every id
is below the vocabulary size (the largest is reported as `vocab_max`), the document offsets start
at 0, increase, end at num_tokens, each document ends in EOS and holds no other EOS (an EOS-scanning
reader such as OLMo-core's document-aware datasets would otherwise see more documents than the
offsets record; allowed where the manifest says `--match-special-tokens` made it so, or where the
source is released token files registered as they are, whose index keeps such a document whole;
then counted, the first few documents named, and what readers see said), and the sha256 matches.
Per directory: the manifest lists exactly the shards on disk, its totals are the sums over them
(and are not 0: a source of no tokens is refused), and (given a tokenizer) its fingerprint,
vocabulary size and EOS match the tokenizer's. A validation split in `val/` is checked the same way.

Loss masks (fine-tuning sources, `manifest.masked`): every shard of a masked source has its mask
(`ShardMeta.mask`, the file present) and no shard of a plain one does (no metadata key, no orphan
`shard-NNNNN.mask`); the mask is one byte per token, each 0 or 1, its sha256 is `mask_checksum`, its
ones are `trained_tokens`, the shards' trained tokens sum to the manifest's, and no padding token
(`pad_id`) is trained. A conversation source prepared with `--long-conversations truncate` may hold
documents that do not end in EOS (the cut ones; open-instruct appends none either): counted, not an
error; anywhere else a document must end in EOS.

Preference pairs (`manifest.preference`, DPO data): every shard says `preference: true` and holds an even
number of documents (a pair never spans shards) with `pairs` = num_docs / 2, and the manifest's `pairs` is
their sum. Each pair (documents 2i, 2i + 1: chosen, rejected) must be what DPO compares: both sides train
at least one token; each side's trained tokens are one run (its final reply: an earlier turn trained too
would be a mask from `--chat-mask assistant`, not a pair's); the two sides are identical up to their first
trained token (they share the prompt, so that token is at the same place in both) and differ somewhere
after it (an identical pair has nothing to prefer). Every failing pair is counted, the first few named.

RL prompts (`manifest.prompts`, GRPO data): every shard names its sidecar (`prompts`, the file present) and no
shard of another source does; the sidecar's sha256 is `prompts_checksum`, it holds one JSON object with a string
`verifier` and a `ground_truth` per document, and its verifier counts are the metadata's `verifiers`, whose sum
over the shards is the manifest's `verifiers`. A prompt
ends in the template's generation prompt, not EOS: its documents are counted, not an error.

How the reading is spread over `workers` processes: a shard's sha256 must read it whole, in order,
so it is one task; the id checks (largest id, EOS count) are cut into ranges of `SCAN_BYTES` and
the document checks (offsets, EOS at each end) are one more task. All shards of both splits go to
one pool at once, the hashes first: 20 shards on 16 workers then cost about 20/16 of a shard's work
instead of two rounds of whole shards, for a second read of each shard (from the page cache, a
tenth of what hashing it costs). The tokenizer (for the fingerprint) loads meanwhile. With one
process, one pass per shard hashes it and checks its ids. Memory stays small: a task holds one
block of `BLOCK_BYTES`.

Check records (`check_shard`, `trust_checks`): data preparation checks each shard in the process that has just
written it and keeps what each reading task found in `shard-NNNNN.check`; its final validation then takes those
results instead of reading the shard again, through the same `_record` and `_finish`, so the verdict is a full read's
of the files as they were written. A record is bound to the shard's metadata and offsets (bytes), the `.bin`'s size and
the split's rules; one that does not hold is ignored and that shard read again. Without `trust_checks` (the default
of `validate_shards.py`) no record is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from olmo_ds.atomic import atomic_write_json
from olmo_ds.data import shards

BLOCK_BYTES = 1 << 24
SCAN_BYTES = 1 << 26  # bytes of ids one id-check task reads


@dataclass
class ShardReport:
    name: str  # relative to the validated directory, e.g. "shard-00001.bin" or "val/shard-00000.bin"
    num_tokens: int = 0
    num_docs: int = 0
    vocab_max: int = -1
    docs_with_inner_eos: int = 0  # documents holding an EOS before their last token
    inner_eos: int = 0  # EOS ids before a document's end: readers that split at EOS see this many documents more
    inner_eos_docs: list[int] = field(default_factory=list)  # the first few such documents (indexes in the shard)
    inner_eos_why: str = ""  # why they are allowed (empty: they are an error)
    trained_tokens: int | None = None  # masked shards: the ones of the loss mask, as counted
    docs_without_eos: int = 0  # truncated conversations (allowed only where the source says so)
    prompts: int | None = None  # RL prompt shards: the sidecar's records, checked
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
    trained_tokens: int | None = None  # masked sources: the total over the shards' masks (train split)
    pairs: int | None = None  # preference sources: the pairs of the train split
    from_checks: int = 0  # shards whose reading was taken from the check record their writer made (`trust_checks`), not read again

    @property
    def ok(self) -> bool:
        return not self.errors and all(s.ok for s in self.shards)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for s, sd in zip(self.shards, d["shards"]):
            sd["ok"] = s.ok
        return d


@dataclass
class _Shard:
    """A shard whose metadata and size are right, and what its reading tasks found."""

    report: ShardReport
    meta: shards.ShardMeta
    bin_file: Path
    offsets_file: Path
    inner_eos_why: str  # why EOS ids inside documents are counted, not an error ("": they are an error; `_Split.inner_eos_why`)
    rules: "ShardRules | None" = None
    mask_file: Path | None = None
    checksum: str = ""
    eos_count: int = 0
    document_errors: list[str] = field(default_factory=list)
    ends_in_eos: bool = False  # the offsets are sound and every document ends in EOS

    @property
    def nbytes(self) -> int:
        return self.meta.num_tokens * np.dtype(self.meta.dtype).itemsize


@dataclass(frozen=True)
class ShardRules:
    """What a split's manifest says its shards must be, beyond the format: masked or not, the padding id
    that must never be trained, whether documents may end without EOS (truncated conversations)."""

    masked: bool = False
    pad_id: int | None = None
    eos_less_ok: bool = False
    preference: bool = False  # documents 2i, 2i + 1 are a (chosen, rejected) pair
    prompts: bool = False  # documents are RL prompts, each with a sidecar record (no EOS at their ends)


def _open_shard(directory: Path, bin_name: str, prefix: str, inner_eos_why: str, rules: ShardRules = ShardRules()) -> tuple[ShardReport, _Shard | None]:
    """The checks that read no ids: metadata, dtype, the `.bin` size, the loss mask's presence and size. None when one fails."""
    report = ShardReport(prefix + bin_name)
    meta_file = (directory / bin_name).with_suffix(".json")
    if not meta_file.is_file():
        report.errors.append(f"missing metadata {meta_file.name}")
        if not (directory / bin_name).is_file():
            report.errors.append("missing .bin file")
        return report, None
    try:
        meta = shards.ShardMeta.load(meta_file)
    except (ValueError, TypeError) as e:
        report.errors.append(f"unreadable metadata: {e}")
        return report, None
    bin_file = directory / meta.bin  # beside it, or (in-place token files) an absolute path elsewhere
    if not bin_file.is_file():
        report.errors.append("missing .bin file" if bin_file.parent == directory else f"missing token file {bin_file}")
        return report, None
    report.num_tokens, report.num_docs = meta.num_tokens, meta.num_docs
    expected_dtype = shards.dtype_for_vocab(meta.vocab_size)
    if meta.dtype != expected_dtype.name:
        report.errors.append(f"dtype {meta.dtype} but vocab_size {meta.vocab_size} needs {expected_dtype.name}")
        return report, None
    itemsize = expected_dtype.itemsize
    size = bin_file.stat().st_size
    if size != meta.num_tokens * itemsize:
        report.errors.append(f"size {size} bytes != num_tokens {meta.num_tokens} x {itemsize} (truncated or corrupt)")
        return report, None
    mask_file = None
    orphan = directory / (Path(bin_name).name.split(".")[0] + ".mask")
    if rules.masked and not meta.masked:
        report.errors.append(f"no loss mask: the manifest says the source is masked, but {meta_file.name} names no mask")
        return report, None
    if not rules.masked and (meta.masked or orphan.is_file()):
        report.errors.append(f"loss mask {meta.mask or orphan.name} on a shard of a source whose manifest is not masked (a mixed or damaged directory)")
        return report, None
    if meta.masked:
        mask_file = directory / meta.mask
        if not mask_file.is_file():
            report.errors.append(f"missing loss mask {meta.mask}")
            return report, None
        if mask_file.stat().st_size != meta.num_tokens:
            report.errors.append(f"loss mask {meta.mask}: {mask_file.stat().st_size} bytes != num_tokens {meta.num_tokens} (one byte per token; truncated or corrupt)")
            return report, None
    if rules.preference != meta.is_preference:
        said = "holds preference pairs" if rules.preference else "does not hold preference pairs"
        report.errors.append(f"{meta_file.name} says preference {meta.preference}, but the manifest {said} (a mixed or damaged directory)")
        return report, None
    if meta.is_preference and (meta.num_docs % 2 or meta.pairs != meta.num_docs // 2):
        report.errors.append(f"{meta.num_docs} documents, metadata pairs {meta.pairs}: a preference shard holds whole (chosen, rejected) "
                             "pairs, num_docs = 2 x pairs")
        return report, None
    if rules.prompts != meta.is_prompts:
        said = "holds RL prompts" if rules.prompts else "does not hold RL prompts"
        report.errors.append(f"{meta_file.name} names prompts {meta.prompts}, but the manifest {said} (a mixed or damaged directory)")
        return report, None
    if meta.is_prompts:
        problem = _prompt_records(directory, meta)
        if problem:
            report.errors.append(problem)
            return report, None
        report.prompts = meta.num_docs
    return report, _Shard(report, meta, bin_file, directory / meta.offsets, inner_eos_why, rules, mask_file)


def _prompt_records(directory: Path, meta: shards.ShardMeta) -> str:
    """What is wrong with an RL prompt shard's sidecar ("" when nothing is); small files, read here whole."""
    path = directory / meta.prompts
    if not path.is_file():
        return f"missing prompt records {meta.prompts}"
    if shards.sha256_file(path) != meta.prompts_checksum:
        return f"prompt records {meta.prompts}: checksum mismatch with metadata prompts_checksum (corrupt or edited)"
    try:
        records = shards.read_prompt_records(path, meta)
    except ValueError as e:
        return str(e.args[0]).replace(str(directory) + "/", "")
    counts: dict = {}
    for r in records:
        counts[r["verifier"]] = counts.get(r["verifier"], 0) + 1
    if counts != (meta.verifiers or {}):
        return f"prompt records {meta.prompts}: verifier counts {dict(sorted(counts.items()))} != metadata verifiers {meta.verifiers}"
    return ""


# ---------------------------------------------------------------------------------------------
# Tasks, run in the workers: each reads one thing and returns a small result.


def _blocks(path: str, start: int, end: int, itemsize: int):
    """Memoryviews of the file's bytes [start, end), in blocks of whole ids, through one reused buffer."""
    buf = bytearray(BLOCK_BYTES - BLOCK_BYTES % itemsize)
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            n = f.readinto(memoryview(buf)[: min(len(buf), end - start)])
            if n == 0:  # shorter than its size said a moment ago: the caller's checks report it
                return
            start += n
            yield memoryview(buf)[:n]


def _scan(path: str, start: int, end: int, dtype: str, eos_id: int, sha256: bool, ids: bool) -> tuple[str, int, int]:
    """Bytes [start, end) of a shard: their sha256 (when asked; the whole file's, when it is the
    whole file), and (when asked) their largest id and number of EOS ids."""
    dt = np.dtype(dtype)
    digest, top, eos = hashlib.sha256(), -1, 0
    for block in _blocks(path, start, end, dt.itemsize):
        if sha256:
            digest.update(block)
        if ids:
            top, eos = _id_stats(block, dt, eos_id, top, eos)
    return "sha256:" + digest.hexdigest() if sha256 else "", top, eos


def _id_stats(block, dtype: np.dtype, eos_id: int, top: int, eos: int) -> tuple[int, int]:
    """(largest id, EOS count) so far, after the ids in `block` (bytes of whole ids)."""
    ids = np.frombuffer(block, dtype=dtype)
    return (max(top, int(ids.max())), eos + int(np.count_nonzero(ids == eos_id))) if len(ids) else (top, eos)


def _documents(bin_file: str, offsets_file: str, meta: shards.ShardMeta, eos_less_ok: bool = False) -> tuple[list[str], bool, int]:
    """Offsets from 0 to num_tokens, increasing, one per document plus one, each document's last id EOS
    (`eos_less_ok`: those that do not are counted, not an error). Returns the problems, whether the
    offsets are sound and every document ends in EOS, and how many do not."""
    if not Path(offsets_file).is_file():
        return [f"missing offsets {meta.offsets}"], False, 0
    try:
        offsets = shards.load_offsets(Path(offsets_file))
    except ValueError as e:
        return [f"unreadable offsets {meta.offsets}: {e}"], False, 0
    if len(offsets) != meta.num_docs + 1:
        return [f"{len(offsets)} offsets for {meta.num_docs} documents (expected num_docs + 1)"], False, 0
    if len(offsets) and (offsets[0] != 0 or offsets[-1] != meta.num_tokens):
        return [f"offsets run {offsets[0]}..{offsets[-1]}, not 0..{meta.num_tokens}"], False, 0
    if np.any(np.diff(offsets) <= 0):
        return [f"offsets not strictly increasing (first at document {int(np.argmax(np.diff(offsets) <= 0))})"], False, 0
    if not meta.num_docs:
        return [], False, 0
    ends = shards.open_tokens(Path(bin_file), meta)[np.asarray(offsets[1:]) - 1]
    bad = np.flatnonzero(ends != meta.eos_id)
    if len(bad) and eos_less_ok:
        return [], False, len(bad)
    if len(bad):
        return [f"{len(bad)} documents do not end in EOS {meta.eos_id} (first: document {int(bad[0])})"], False, len(bad)
    return [], True, 0


def _mask(bin_file: str, mask_file: str, meta: shards.ShardMeta, pad_id: int | None) -> tuple[str, int, str]:
    """A shard's loss mask against its ids: its sha256, its ones, and the first problem ("" if none):
    a value that is not 0 or 1, or a trained padding token."""
    tokens = shards.open_tokens(Path(bin_file), meta)
    raw = shards.map_file(Path(mask_file))[: meta.num_tokens]
    digest, trained, problem = hashlib.sha256(), 0, ""
    step = BLOCK_BYTES
    for a in range(0, meta.num_tokens, step):
        block = np.asarray(raw[a:a + step])
        digest.update(block.tobytes())
        trained += int(np.count_nonzero(block))
        if not problem and (bad := np.flatnonzero(block > 1)).size:
            problem = f"loss mask {meta.mask}: byte {a + int(bad[0])} is {int(block[bad[0]])}, not 0 or 1"
        if not problem and pad_id is not None:
            hit = np.flatnonzero((block != 0) & (np.asarray(tokens[a:a + step]) == pad_id))
            if hit.size:
                problem = f"loss mask {meta.mask}: padding token {pad_id} trained at token {a + int(hit[0])} ({hit.size} in this block): padding must never be a target"
    return "sha256:" + digest.hexdigest(), trained, problem


PAIR_PROBLEMS = {
    "no_target": "train no token on one side (each side must train its final reply)",
    "not_final_reply": "train more than one run of tokens on a side (only the final reply of a pair is trained)",
    "prompt_differs": "differ before their first trained token (the two sides must share every message but the final reply)",
    "identical": "have identical sides (nothing to prefer)",
}
PAIRS_SHOWN = 3  # failing pairs named per kind


def _pairs(bin_file: str, offsets_file: str, mask_file: str, meta: shards.ShardMeta) -> list[str]:
    """Each pair of a preference shard against the rules of the module docstring: one problem line per kind
    found (how many pairs, the first few named). Reads the shard in blocks of about `BLOCK_BYTES` tokens of pairs."""
    try:
        offsets = np.asarray(shards.load_offsets(Path(offsets_file)), dtype=np.int64)
    except ValueError:
        return []  # the documents task reports it
    if len(offsets) != meta.num_docs + 1 or meta.num_docs % 2 or np.any(np.diff(offsets) <= 0):
        return []  # the documents task (or the metadata check) reports it
    tokens = shards.open_tokens(Path(bin_file), meta)
    mask = shards.map_file(Path(mask_file))[: meta.num_tokens]
    found: dict[str, list[int]] = {k: [] for k in PAIR_PROBLEMS}
    counts = dict.fromkeys(PAIR_PROBLEMS, 0)
    d0 = 0
    while d0 < meta.num_docs:
        d1 = int(np.searchsorted(offsets, offsets[d0] + BLOCK_BYTES, side="right")) - 1
        d1 = max(d0 + 2, d1 - d1 % 2)
        lo = int(offsets[d0])
        starts = offsets[d0:d1] - lo
        m = np.asarray(mask[lo:int(offsets[d1])]) != 0
        rise = m.copy()
        rise[1:] &= ~m[:-1]
        rise[starts] = m[starts]  # a run that starts a document
        runs = np.add.reduceat(rise.astype(np.int64), starts)
        at = np.flatnonzero(rise)
        doc_of = np.searchsorted(starts, at, side="right") - 1
        first = np.full(len(starts), -1, dtype=np.int64)
        docs, where = np.unique(doc_of, return_index=True)
        first[docs] = at[where] - starts[docs]
        for c in range(0, len(starts), 2):
            pair = (d0 + c) // 2
            a, b, e = int(offsets[d0 + c]), int(offsets[d0 + c + 1]), int(offsets[d0 + c + 2])
            if runs[c] == 0 or runs[c + 1] == 0:
                kind = "no_target"
            elif runs[c] > 1 or runs[c + 1] > 1:
                kind = "not_final_reply"
            elif first[c] != first[c + 1] or tokens[a:a + first[c]].tobytes() != tokens[b:b + first[c]].tobytes():
                kind = "prompt_differs"
            elif b - a == e - b and tokens[a:b].tobytes() == tokens[b:e].tobytes():
                kind = "identical"
            else:
                continue
            counts[kind] += 1
            if len(found[kind]) < PAIRS_SHOWN:
                found[kind].append(pair)
        d0 = d1
    return [f"{counts[k]} pairs {PAIR_PROBLEMS[k]}; first: " + ", ".join(f"pair {j} (documents {2 * j}, {2 * j + 1})" for j in found[k])
            + (", ..." if counts[k] > len(found[k]) else "") for k in PAIR_PROBLEMS if counts[k]]


INNER_EOS_SHOWN = 5  # documents with an inner EOS named in the report


def _inner_eos(bin_file: str, offsets_file: str, meta: shards.ShardMeta) -> tuple[int, int, list[int], int]:
    """More EOS ids than documents: how many documents hold one before their end, how many such
    EOS ids there are, the first few such documents and the first such token (only run when that is so)."""
    tokens = shards.open_tokens(Path(bin_file), meta)
    offsets = np.asarray(shards.load_offsets(Path(offsets_file)))
    is_end = np.zeros(len(tokens), dtype=bool)
    is_end[offsets[1:] - 1] = True
    inner = np.flatnonzero((np.asarray(tokens) == meta.eos_id) & ~is_end)
    docs = np.unique(np.searchsorted(offsets, inner, side="right") - 1)
    return len(docs), len(inner), docs[:INNER_EOS_SHOWN].tolist(), int(inner[0])


_TASKS = {"scan": _scan, "documents": _documents, "inner_eos": _inner_eos, "mask": _mask, "pairs": _pairs}


def _run(task: tuple) -> tuple:
    kind, k, args = task
    return kind, k, _TASKS[kind](*args)


def _first_round(k: int, s: _Shard, split: bool) -> tuple[tuple, list[tuple]]:
    """Shard k's reading tasks: the one that hashes it (reading it whole), and the others: its
    documents, and (`split`) its id checks cut into ranges for other workers; without `split` the
    hashing pass checks the ids too."""
    m = s.meta
    path, dtype = str(s.bin_file), np.dtype(m.dtype).newbyteorder("<").str
    rules = s.rules or ShardRules()
    others = [("documents", k, (path, str(s.offsets_file), m, rules.eos_less_ok))]
    if s.mask_file is not None:
        others.append(("mask", k, (path, str(s.mask_file), m, rules.pad_id)))
    if s.mask_file is not None and m.is_preference:
        others.append(("pairs", k, (path, str(s.offsets_file), str(s.mask_file), m)))
    if split:
        step = SCAN_BYTES - SCAN_BYTES % np.dtype(dtype).itemsize
        others += [("scan", k, (path, a, min(a + step, s.nbytes), dtype, m.eos_id, False, True)) for a in range(0, s.nbytes, step)]
    return ("scan", k, (path, 0, s.nbytes, dtype, m.eos_id, True, not split)), others


def _record(s: _Shard, kind: str, value) -> None:
    if kind == "scan":
        checksum, top, eos = value
        s.checksum = checksum or s.checksum
        s.report.vocab_max = max(s.report.vocab_max, top)
        s.eos_count += eos
    elif kind == "documents":  # its problems go first, whenever it finishes among the shard's tasks
        errors, s.ends_in_eos, s.report.docs_without_eos = value
        s.document_errors = [*errors, *s.document_errors]
    elif kind == "mask":
        checksum, trained, problem = value
        m = s.meta
        s.report.trained_tokens = trained
        if checksum != m.mask_checksum:
            s.document_errors.append(f"loss mask {m.mask}: checksum mismatch: {checksum} != metadata {m.mask_checksum}")
        if trained != m.trained_tokens:
            s.document_errors.append(f"loss mask {m.mask}: {trained} trained tokens != metadata trained_tokens {m.trained_tokens}")
        if problem:
            s.document_errors.append(problem)
    elif kind == "pairs":
        s.document_errors += value
    else:
        docs, inner, first_docs, first_token = value
        r = s.report
        r.docs_with_inner_eos, r.inner_eos, r.inner_eos_docs, r.inner_eos_why = docs, inner, first_docs, s.inner_eos_why
        if not s.inner_eos_why:
            s.document_errors.append(
                f"{docs} documents hold EOS {s.meta.eos_id} before their end (first: document {first_docs[0]}, token {first_token}): "
                "readers that split documents at EOS would disagree with the offsets; prepare again without --match-special-tokens"
            )


def _finish(s: _Shard) -> None:
    """The shard's verdict from what its tasks found, in the order the checks are listed above."""
    r, m = s.report, s.meta
    if r.vocab_max >= m.vocab_size:
        r.errors.append(f"token id {r.vocab_max} >= vocab_size {m.vocab_size}")
    if r.vocab_max != m.max_token_id:
        r.errors.append(f"max token id {r.vocab_max} != metadata max_token_id {m.max_token_id}")
    if s.checksum != m.checksum:
        r.errors.append(f"checksum mismatch: {s.checksum} != metadata {m.checksum}")
    r.errors += s.document_errors


def _needs_inner_eos(s: _Shard) -> bool:
    """Whether the shard has more EOS ids than documents ending in one: then which documents hold them is read."""
    return bool(s.ends_in_eos or s.report.docs_without_eos) and s.eos_count != s.meta.num_docs - s.report.docs_without_eos


def _check_shards(entries: list[tuple], workers: int, meanwhile: Callable[[], None], trust_checks: bool = False) -> tuple[list[ShardReport], int]:
    """Every per-shard check of `entries` (directory, .bin name, report prefix, why inner EOS is allowed, `ShardRules`), the
    reading spread over `workers` processes; `meanwhile` runs here while they read. `trust_checks`: a shard whose check
    record holds (`read_check`) has its reading's results taken from it instead. Returns the reports and how many were."""
    opened = [_open_shard(*e) for e in entries]
    todo = {k: s for k, (_, s) in enumerate(opened) if s is not None}
    recorded = {k: found for k, s in todo.items() if trust_checks and (found := read_check(entries[k][0], entries[k][1], s)) is not None}
    rounds = {k: _first_round(k, s, split=workers > 1) for k, s in todo.items() if k not in recorded}
    # The hashes first, largest first: each reads a whole shard, and the shorter tasks fill in around them.
    tasks = [rounds[k][0] for k in sorted(rounds, key=lambda k: -todo[k].nbytes)] + [t for _, others in rounds.values() for t in others]
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(mp.get_context("fork").Pool(min(workers, len(tasks)))) if workers > 1 and len(tasks) > 1 else None
        run = (lambda ts: pool.imap_unordered(_run, ts)) if pool else (lambda ts: map(_run, ts))
        results = run(tasks)
        meanwhile()
        for kind, k, value in results:
            _record(todo[k], kind, value)
        for k, found in recorded.items():
            for kind, value in found:
                _record(todo[k], kind, value)
        second = [("inner_eos", k, (str(s.bin_file), str(s.offsets_file), s.meta)) for k, s in todo.items() if k not in recorded and _needs_inner_eos(s)]
        for kind, k, value in run(second):
            _record(todo[k], kind, value)
    for s in todo.values():
        _finish(s)
    return [report for report, _ in opened], len(recorded)


# ---------------------------------------------------------------------------------------------
# Check records: a shard checked by the process that wrote it, so that the final validation need not read it again.

CHECK_SUFFIX = ".check"  # not .json: a `shard-*.json` glob must keep finding the metadata alone
CHECK_VERSION = 1


def check_path(directory: Path, bin_name: str) -> Path:
    """`shard-NNNNN.check` beside `shard-NNNNN.bin`."""
    return Path(directory) / (Path(bin_name).name.split(".")[0] + CHECK_SUFFIX)


def _record_digest(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_binding(directory: Path, bin_name: str, s: _Shard) -> dict:
    """What a check record is bound to besides its rules: the shard's metadata file (its `.bin`'s sha256, its mask's and
    sidecar's, its counts) and its offsets, byte for byte; the `.bin`'s size is checked by `_open_shard` every time."""
    meta_file = (Path(directory) / bin_name).with_suffix(".json")
    return {"shard": Path(bin_name).name, "metadata_sha256": shards.sha256_file(meta_file),
            "offsets_sha256": shards.sha256_file(s.offsets_file) if s.offsets_file.is_file() else None, "bin_bytes": s.nbytes}


class ReadBack:
    """The whole-file reading of a shard (`_scan`: the sha256 of its bytes as read from the file, its largest id, its EOS
    count), made while the shard is written: the file's prefix up to some point is final, and each call reads on from
    the last (`read`). `check_shard` takes it instead of reading the whole file when the shard is closed, so a shard's
    check no longer waits for one pass over all of it at the end, after the last part: in data preparation's
    whole-file mode that pass, over the last shard, was the run's tail while every other worker had nothing left to
    do (`prepare.pieces.Assembly` reads each shard's parts back in order as they land)."""

    def __init__(self, dtype, eos_id: int, ids: bool = True):
        self.dtype, self.eos_id = np.dtype(dtype).newbyteorder("<"), int(eos_id)
        self.ids = ids  # False: the largest id and the EOS count come from the writers (`take_ids`), who compared their ids with the file's
        self._digest, self._top, self._eos = hashlib.sha256(), -1, 0
        self.done = 0  # bytes of the file read back so far

    def read(self, path: Path, end: int) -> None:
        """Read the file's bytes [done, end) back: what the writer has written (and flushed) since the last call."""
        for block in _blocks(str(path), self.done, end, self.dtype.itemsize):
            self._digest.update(block)
            if self.ids:
                self._top, self._eos = _id_stats(block, self.dtype, self.eos_id, self._top, self._eos)
            self.done += len(block)

    def take_ids(self, top: int, eos: int) -> None:
        """The largest id and EOS count of some of the file's ids, found by the process that wrote them and read them
        back (`shards.ShardInParts.write`): that work is spread over the writers, and the reading here, the one step
        of a shard that must go in order, only hashes."""
        self._top, self._eos = max(self._top, int(top)), self._eos + int(eos)

    def reading(self) -> tuple[str, int, int]:
        """What `_scan` of the whole file gives: its sha256, largest id, EOS count."""
        return "sha256:" + self._digest.hexdigest(), self._top, self._eos


def check_shard(directory: Path, bin_name: str, rules: ShardRules, inner_eos_why: str = "", read_back: ReadBack | None = None) -> ShardReport:
    """Every check `validate_directory` makes of one shard, run here (data preparation calls it in the process that has
    just written the shard, while its bytes are in the page cache), and a check record beside it (`check_path`) holding
    what each reading found, bound to the shard's metadata, offsets and `rules`. `validate_directory(trust_checks=True)`
    takes those results instead of reading the shard again, through the same verdict code, so its verdict is the one a
    full read would give the files as they were checked; `validate_shards.py` without `--trust-checks` reads everything."""
    report, s = _open_shard(Path(directory), bin_name, "", inner_eos_why, rules)
    if s is None:
        return report  # a shard that fails before any reading gets no record: the final validation finds the same
    found = []
    first, others = _first_round(0, s, split=False)
    # `read_back`: the whole-file reading made as the shard was written; it covers the file only if it read all of it.
    whole = ("scan", 0, read_back.reading()) if read_back is not None and read_back.done == s.nbytes else _run(first)
    for kind, _, value in [whole, *map(_run, others)]:
        _record(s, kind, value)
        found.append([kind, value])
    if _needs_inner_eos(s):
        kind, _, value = _run(("inner_eos", 0, (str(s.bin_file), str(s.offsets_file), s.meta)))
        _record(s, kind, value)
        found.append([kind, value])
    _finish(s)
    record = {"version": CHECK_VERSION, **_check_binding(directory, bin_name, s), "rules": asdict(rules), "inner_eos_why": inner_eos_why,
              "found": found}
    atomic_write_json(check_path(directory, bin_name), {**record, "record_sha256": _record_digest(record)})
    return report


def read_check(directory: Path, bin_name: str, s: _Shard) -> list | None:
    """The readings' results of a shard's check record (`check_shard`), or None when the record is missing, unreadable,
    edited (its own sha256), or does not hold for the shard as it is now (its metadata or offsets changed, other rules):
    that shard is then read again in full."""
    path = check_path(directory, bin_name)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != CHECK_VERSION or record.get("record_sha256") != _record_digest(record):
        return None
    rules = s.rules or ShardRules()
    if (record.get("rules") != asdict(rules) or record.get("inner_eos_why") != s.inner_eos_why
            or {k: record.get(k) for k in ("shard", "metadata_sha256", "offsets_sha256", "bin_bytes")} != _check_binding(directory, bin_name, s)):
        return None
    return record["found"]


@dataclass
class _Split:
    """One directory to validate (the shards, or their `val/` split) and what lists its shards."""

    directory: Path
    prefix: str  # before the shard names in the report: "" or "val/"
    manifest: shards.Manifest | None = None
    listed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, directory: Path, prefix: str) -> "_Split":
        split = cls(directory, prefix)
        if not directory.is_dir():
            split.errors.append(f"{directory}: not a directory")
            return split
        on_disk = [p.name for p in shards.list_shards(directory)]
        try:
            split.manifest = shards.Manifest.load(directory)
        except (OSError, ValueError, TypeError, json.JSONDecodeError) as e:
            split.errors.append(f"{prefix}{shards.MANIFEST}: {e}")
        split.listed = split.manifest.shards if split.manifest else on_disk
        split.errors += [f"{prefix}{name}: on disk but not in {shards.MANIFEST}" for name in sorted(set(on_disk) - set(split.listed))]
        return split

    @property
    def inner_eos_why(self) -> str:
        return inner_eos_reason(self.manifest.extra if self.manifest else {})

    @property
    def rules(self) -> ShardRules:
        if self.manifest is None:
            return ShardRules()
        return split_rules(self.manifest.masked, self.manifest.preference, self.manifest.prompts, self.manifest.extra)


def inner_eos_reason(extra: dict) -> str:
    """Why documents may hold EOS before their end in a split whose manifest's extra keys are `extra` ("" where
    that is an error): prepared with --match-special-tokens, or released token files registered as they are (their
    index keeps such a document whole; preparing them again is not the user's to do)."""
    if extra.get("source", {}).get("in_place"):
        return "released token files, registered as they are: their index keeps these documents whole"
    if extra.get("arguments", {}).get("match_special_tokens"):
        return "prepared with --match-special-tokens"
    return ""


def split_rules(masked: bool, preference: bool, prompts: bool, extra: dict) -> ShardRules:
    """What a split's manifest (its `masked`, `preference`, `prompts` and extra keys) says its shards must be;
    data preparation calls it with what the manifest will say, to check each shard as it is written."""
    return ShardRules(masked, extra.get("pad_id"), (extra.get("chat") or {}).get("long_conversations") == "truncate" or prompts, preference, prompts)


def validate_directory(directory: Path, tokenizer=None, workers: int = 1, trust_checks: bool = False) -> Report:
    """Validate a shard directory and its `val/` split; `workers` processes read the shards.
    `tokenizer`: a loaded `Tokenizer`, a function that loads one (called while the workers read,
    so that loading it costs no time), or None. `trust_checks`: take each shard's reading from the check record its
    writer made (`check_shard`) where that record holds; every other check (metadata, sizes, masks' and sidecars'
    presence, the sidecars themselves, the manifests, the tokenizer) runs as without it."""
    directory = Path(directory)
    report = Report(str(directory))
    if not directory.is_dir():
        report.errors.append(f"{directory}: not a directory")
        return report
    splits = [_Split.read(directory, "")]
    val = splits[0].manifest.extra.get("val") if splits[0].manifest else None
    if val:
        splits.append(_Split.read(directory / val["dir"], f"{val['dir']}/"))
    entries = [(s.directory, name, s.prefix, s.inner_eos_why, s.rules) for s in splits for name in s.listed]
    loaded = {}

    def load() -> None:
        loaded["tokenizer"] = tokenizer() if callable(tokenizer) else tokenizer

    reports, report.from_checks = _check_shards(entries, workers, load, trust_checks)
    for s in splits:
        mine, reports = reports[: len(s.listed)], reports[len(s.listed) :]
        tokens, docs = sum(r.num_tokens for r in mine), sum(r.num_docs for r in mine)
        if s.manifest is not None:
            _check_manifest(s, mine, tokens, docs, loaded["tokenizer"])
            if s.manifest.masked:
                _check_trained(s, mine)
                if not s.prefix:
                    report.trained_tokens = sum(r.trained_tokens or 0 for r in mine)
            if s.manifest.prompts:
                _check_verifiers(s, mine)
            if s.manifest.preference:
                pairs = _check_pairs(s, mine)
                if not s.prefix:
                    report.pairs = pairs
        report.shards += mine
        report.errors += s.errors
        report.num_tokens += tokens
        report.num_docs += docs
        if not s.prefix and not tokens and not s.errors:
            report.errors.append(f"{directory}: holds no tokens (0 documents in {len(s.listed)} shards): a source with nothing to train on; "
                                 "prepare it again from inputs that hold documents")
        if s.prefix and (docs, tokens) != (val["num_docs"], val["num_tokens"]):
            report.errors.append(f"{shards.MANIFEST}: val split is {val['num_docs']} docs / {val['num_tokens']} tokens, but {val['dir']}/ holds {docs} / {tokens}")
    return report


def _check_manifest(split: _Split, reports: list[ShardReport], tokens: int, docs: int, tokenizer) -> None:
    manifest, where = split.manifest, f"{split.prefix}{shards.MANIFEST}"
    if manifest.num_tokens != tokens or manifest.num_docs != docs:
        split.errors.append(f"{where}: totals {manifest.num_docs} docs / {manifest.num_tokens} tokens != sum over shards {docs} / {tokens}")
    for s in reports:
        meta_file = (split.directory / Path(s.name).name).with_suffix(".json")
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
        if not tokenizer.matches(manifest.tokenizer_fingerprint):
            split.errors.append(f"{where}: tokenizer fingerprint {manifest.tokenizer_fingerprint} != {tokenizer.fingerprint} of {tokenizer.path} (shards made with another tokenizer)")
        if manifest.vocab_size != tokenizer.vocab_size:
            split.errors.append(f"{where}: vocab_size {manifest.vocab_size} != the tokenizer's {tokenizer.vocab_size}")
        if manifest.eos_id != tokenizer.eos_id:
            split.errors.append(f"{where}: eos_id {manifest.eos_id} != the tokenizer's {tokenizer.eos_id}")


def _check_verifiers(split: _Split, reports: list[ShardReport]) -> None:
    """An RL prompt split's verifier counts: the manifest's against the sum over the shards' metadata (each shard's
    own counts against its sidecar are checked with the shard)."""
    total: dict[str, int] = {}
    for s in reports:
        try:
            counts = shards.ShardMeta.load((split.directory / Path(s.name).name).with_suffix(".json")).verifiers or {}
        except (OSError, ValueError, TypeError):
            return  # the shard's own report says why
        for name, n in counts.items():
            total[name] = total.get(name, 0) + n
    recorded = split.manifest.extra.get("verifiers")
    if recorded != dict(sorted(total.items())):
        split.errors.append(f"{split.prefix}{shards.MANIFEST}: verifiers {recorded} != sum over the shards' metadata {dict(sorted(total.items()))}")


def _check_trained(split: _Split, reports: list[ShardReport]) -> None:
    """A masked split's trained-token total: the manifest's against the shards' metadata (each shard's own
    count against its mask is checked with the shard)."""
    where = f"{split.prefix}{shards.MANIFEST}"
    recorded = split.manifest.extra.get("trained_tokens")
    metas = []
    for s in reports:
        meta_file = (split.directory / Path(s.name).name).with_suffix(".json")
        try:
            metas.append(shards.ShardMeta.load(meta_file).trained_tokens or 0)
        except (OSError, ValueError, TypeError):
            return  # the shard's own report says why
    if recorded != sum(metas):
        split.errors.append(f"{where}: trained_tokens {recorded} != sum over the shards' metadata {sum(metas)}")
    if split.manifest.extra.get("pad_id") is None:
        split.errors.append(f"{where}: a masked source must record pad_id (the padding id that is never trained)")


def _check_pairs(split: _Split, reports: list[ShardReport]) -> int:
    """A preference split's pair total: the manifest's against the shards' metadata (each shard's own count
    against its documents is checked with the shard); returns the shards' total."""
    where = f"{split.prefix}{shards.MANIFEST}"
    total = 0
    for s in reports:
        try:
            total += shards.ShardMeta.load((split.directory / Path(s.name).name).with_suffix(".json")).pairs or 0
        except (OSError, ValueError, TypeError):
            return total  # the shard's own report says why
    if split.manifest.extra.get("pairs") != total:
        split.errors.append(f"{where}: pairs {split.manifest.extra.get('pairs')} != sum over the shards' metadata {total}")
    if not split.manifest.masked:
        split.errors.append(f"{where}: preference: true without masked: true; each side of a pair needs its loss mask")
    return total


def describe_inner_eos(docs: int, inner: int, first_docs: list[int], num_docs: int) -> str:
    """What readers see of documents that hold EOS before their end (shared with the registration's report)."""
    shown = ", ".join(map(str, first_docs)) + (", ..." if docs > len(first_docs) else "")
    return (f"{docs:,} documents hold EOS inside (documents {shown}): olmo-ds reads the {num_docs:,} documents of the offsets; "
            f"a reader that splits at EOS (OLMo-core without the index) sees {num_docs + inner:,}, each of these cut at its inner EOS")


def format_report(report: Report) -> str:
    """One line per shard, the directory-level problems, then a totals line."""
    lines = []
    for s in report.shards:
        if s.ok:
            trained = f", {s.trained_tokens:,} trained" if s.trained_tokens is not None else ""
            lines.append(f"{s.name}: OK ({s.num_tokens:,} tokens{trained}, vocab_max={s.vocab_max})")
            if s.prompts is not None:
                lines.append(f"  {s.prompts:,} RL prompts, each ending in the generation prompt, each with its verifier and ground truth")
            elif s.docs_without_eos:
                lines.append(f"  {s.docs_without_eos:,} documents end without EOS (conversations cut by --max-tokens with --long-conversations truncate, as open-instruct cuts them)")
            if s.docs_with_inner_eos:
                lines.append(f"  {describe_inner_eos(s.docs_with_inner_eos, s.inner_eos, s.inner_eos_docs, s.num_docs)} ({s.inner_eos_why})")
        else:
            lines.append(f"{s.name}: FAIL: {'; '.join(s.errors)}")
    lines += [f"error: {e}" for e in report.errors]
    bad = sum(not s.ok for s in report.shards)
    status = "OK" if report.ok else f"FAIL ({bad} bad shards, {len(report.errors)} other problems)"
    trained = f", {report.trained_tokens:,} trained (loss mask)" if report.trained_tokens is not None else ""
    trained += f", {report.pairs:,} preference pairs" if report.pairs is not None else ""
    lines.append(f"total: {status}: {len(report.shards)} shards, {report.num_docs:,} docs, {report.num_tokens:,} tokens{trained}")
    return "\n".join(lines)
