"""Raw text → token shards (see `olmo_ds/data/shards.py` for the format), exact and restartable.

The promise users rely on: without a validation split, the concatenation of `DIR/shard-*.bin` in
name order is exactly the input documents' ids in input order (files sorted, lines in file order),
each followed by EOS, whatever the number of workers. Hence the design:

- The main process hands out blocks of whole lines; a pool of worker processes reads (uncompressed
  files: each worker reads its own byte range, `readers.iter_ranges`), parses JSON and tokenizes
  them (`pool_layout`: N workers are N processes when a core is spare for the main process,
  otherwise N - 1 and the main process tokenizes whenever it would wait). Compressed streams can
  only be decompressed in order, so the main process reads and cuts those (`readers.iter_chunks`).
  Workers number lines within their block and the main process, which sees blocks in input order,
  turns them into file lines; results come back in submission order, so output order is input
  order for any worker count. At most `2 × workers` blocks are in
  flight, so memory is bounded by the block size, never by the corpus or a file.
- Shards are streamed to temporary files and renamed when complete, metadata last
  (`shards.ShardWriter`). Each shard's metadata records the input position just after its last
  document (`next_record`) and the skip counts up to there, so a rerun after a kill resumes from
  the last complete shard and produces byte-identical output.
- A validation split (`val_fraction`) is chosen by a hash of each document's text: the same for
  any worker count or resume point, and duplicates of a document always land in the same split.
- Tokenizing with HF `tokenizers` is most of the cost, so an HF tokenizer.json is encoded with
  `fastokens` (10-30x faster on one core) once it has given HF's exact ids on a sample of this
  input and on `tokenizer.ADVERSARIAL_TEXTS`; otherwise HF encodes, with a warning naming the first
  difference (`_select_backend`). The manifest records which library ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import olmo_ds
from olmo_ds.atomic import atomic_write_json
from olmo_ds.data import readers, shards
from olmo_ds.data.pool import OrderedPool
from olmo_ds.tokenizer import ADVERSARIAL_TEXTS, FastBackendError, fast_beside, first_difference, load_tokenizer

# A position in the input is (file index, line) packed into one int, so positions compare in input order.
_LINE_BITS = 40
STATE_FILE = ".prepare.json"
VAL_DIR = "val"
MAX_EXAMPLES = 5  # file:line examples kept per skip reason


class PrepareError(Exception):
    """Bad input or an output directory we must not touch; the message says what and where."""


def position(file_index: int, line: int) -> int:
    return (file_index << _LINE_BITS) | line


def split_position(pos: int) -> tuple[int, int]:
    return pos >> _LINE_BITS, pos & ((1 << _LINE_BITS) - 1)


@dataclass
class PrepareConfig:
    inputs: list[str]
    output: Path
    tokenizer: str
    text_field: str = "text"
    workers: int = 1
    shard_tokens: int = 100_000_000
    val_fraction: float = 0.0
    eos_token: str | None = None
    dry_run: bool = False
    verbose: bool = False
    strict: bool = False
    overwrite: bool = False
    tokenizer_backend: str = "auto"  # "auto" | "fast" | "hf"; see _select_backend
    chunk_bytes: int = readers.CHUNK_BYTES
    progress: bool | None = None  # None: a progress bar only when stderr is a terminal

    def validate(self) -> None:
        if self.workers < 1:
            raise PrepareError(f"--workers must be >= 1, got {self.workers}")
        if self.shard_tokens < 1:
            raise PrepareError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise PrepareError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.tokenizer_backend not in ("auto", "fast", "hf"):
            raise PrepareError(f"--tokenizer-backend must be auto, fast or hf, got {self.tokenizer_backend!r}")
        if not self.text_field:
            raise PrepareError("--text-field must not be empty")


@dataclass
class SkipLog:
    """Skipped records by reason, with the first few `file:line` examples of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def copy(self) -> "SkipLog":
        return SkipLog(dict(self.counts), {k: list(v) for k, v in self.examples.items()})

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": dict(sorted(self.examples.items()))}

    @classmethod
    def from_dict(cls, d: dict) -> "SkipLog":
        return cls(dict(d["counts"]), {k: list(v) for k, v in d["examples"].items()})


@dataclass
class FileStats:
    path: str
    bytes: int
    docs: int = 0
    tokens: int = 0
    skipped: int = 0


@dataclass
class PrepareResult:
    output: Path | None
    files: list[FileStats]
    num_docs: int
    num_tokens: int
    val_docs: int
    val_tokens: int
    num_shards: int
    skipped: SkipLog
    seconds: float
    text_bytes: int  # decompressed input read by this run
    run_tokens: int  # tokens produced by this run (less than the totals after a resume)
    resumed_from: str | None = None
    already_complete: bool = False
    backend: str = ""  # the library that encoded: fastokens, tokenizers or sentencepiece
    layout: str = ""  # who tokenized (`pool_layout`), for the summary


# ---------------------------------------------------------------------------------------------
# Worker side: parse and tokenize one block.

# Per worker process: the loaded tokenizer for a `_Spec`, so each worker loads it once.
_loaded: dict = {}


@dataclass(frozen=True)
class _Spec:
    """What a worker needs to tokenize a block the same way as every other worker."""

    tokenizer: str
    eos_token: str | None
    backend: str  # "hf" | "fast": which encoder `load_tokenizer` builds
    text_field: str
    val_fraction: float


def _single_threaded() -> None:
    # One process per core: tokenizer libraries must not start threads of their own.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def _thread_count() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: not Linux
        return None


def _start_method(threads_before: int | None) -> str:
    """fork, so that workers inherit the loaded and checked tokenizer for free, unless loading or
    running it started threads (a library's thread pool would be inherited without its threads):
    then the workers are spawned and load the tokenizer themselves."""
    now = _thread_count()
    return "fork" if now is not None and threads_before is not None and now <= threads_before else "spawn"


def _tokenizer_for(spec: _Spec):
    if spec not in _loaded:
        _loaded[spec] = load_tokenizer(spec.tokenizer, spec.eos_token, backend=spec.backend)
    return _loaded[spec]


@dataclass
class ChunkResult:
    file_index: int
    tokens: np.ndarray  # the documents' ids, each followed by EOS, in the shard dtype
    doc_lens: np.ndarray  # int64 tokens per document, EOS included
    positions: np.ndarray  # int64 input position of each document (line within the block until `at_line`)
    is_val: np.ndarray | None  # bool per document, when there is a validation split
    skips: list[tuple[int, str]]  # (position, reason), like `positions`
    text_bytes: int
    n_lines: int  # newlines in the block: the next block starts this many lines later

    def at_line(self, first_line: int) -> None:
        """Turn block-relative line numbers into the file's, the block starting at `first_line`."""
        self.positions += first_line
        self.skips = [(p + first_line, reason) for p, reason in self.skips]


def val_hash(text: str) -> int:
    """A stable 64-bit hash of a document's text; documents below fraction × 2^64 go to validation."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def append_eos(ids: np.ndarray, offsets: np.ndarray, eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids of a batch (`encode_batch_flat`) → each document's ids followed by EOS, in the
    shard dtype, and the documents' lengths including EOS. Document i moves right by i slots."""
    doc_lens = np.diff(offsets) + 1
    tokens = np.empty(len(ids) + len(doc_lens), dtype=dtype)
    is_eos = np.zeros(len(tokens), dtype=bool)
    is_eos[np.cumsum(doc_lens) - 1] = True
    tokens[is_eos] = eos_id
    tokens[~is_eos] = ids
    return tokens, doc_lens


def _process_chunk(spec: _Spec, file_index: int, block: readers.Block) -> ChunkResult:
    """Read (unless the coordinating process already did), parse and tokenize one block. Lines are
    numbered from 0 within the block (see `ChunkResult.at_line`)."""
    tok = _tokenizer_for(spec)
    records, n_lines, text_bytes = readers.load_block(block, spec.text_field)
    base = position(file_index, 0)
    texts = [text for _, text, _ in records if text is not None]
    positions = np.array([base + line for line, text, _ in records if text is not None], dtype=np.int64)
    skips = [(base + line, reason) for line, text, reason in records if text is None]
    ids, offsets = tok.encode_batch_flat(texts) if texts else (np.zeros(0, np.uint32), np.zeros(1, np.int64))
    tokens, doc_lens = append_eos(ids, offsets, tok.eos_id, shards.dtype_for_vocab(tok.vocab_size))
    is_val = None
    if spec.val_fraction > 0:
        threshold = int(spec.val_fraction * 2**64)
        is_val = np.array([val_hash(t) < threshold for t in texts], dtype=bool)
    return ChunkResult(file_index, tokens, doc_lens, positions, is_val, skips, text_bytes, n_lines)


# ---------------------------------------------------------------------------------------------
# Main side: output directory state, ordered pool, shard writers.


class _SplitWriter:
    """The shards of one split (train or val), skipping documents already in complete shards."""

    def __init__(self, directory: Path, shard_tokens: int, vocab_size: int, eos_id: int, next_index: int, resume_pos: int):
        self.directory = directory
        self.sharded = shards.ShardedWriter(directory, shard_tokens, vocab_size=vocab_size, eos_id=eos_id, next_index=next_index)
        self.resume_pos = resume_pos  # documents before this input position are already in complete shards

    @property
    def next_index(self) -> int:
        return self.sharded.next_index

    def add(self, tokens: np.ndarray, lens: np.ndarray, positions: np.ndarray, state_at: Callable[[int], dict]) -> None:
        if len(lens) and positions[0] < self.resume_pos:
            keep = positions >= self.resume_pos
            tokens, lens, positions = tokens[np.repeat(keep, lens)], lens[keep], positions[keep]
        self.sharded.add(tokens, lens, lambda k: self._resume_point(int(positions[k]), state_at(int(positions[k]))))

    @staticmethod
    def _resume_point(next_record: int, skipped: dict) -> dict:
        return {"prepare": {"next_record": list(split_position(next_record)), "skipped": skipped}}

    def finish(self, end: int, skipped: dict) -> None:
        self.sharded.finish(self._resume_point(end, skipped))

    def abort(self) -> None:
        self.sharded.abort()


def _identity(cfg: PrepareConfig, files: list[Path], tok) -> dict:
    """What must match for a rerun to continue the same output: the tokenizer, the arguments that
    change the bytes, and the inputs (path, size, mtime)."""
    return {
        "tokenizer_fingerprint": tok.fingerprint,
        "eos_id": tok.eos_id,
        "text_field": cfg.text_field,
        "shard_tokens": cfg.shard_tokens,
        "val_fraction": cfg.val_fraction,
        "inputs": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }


def _our_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_file() and (p.name.startswith(shards.SHARD_PREFIX) or p.name in (shards.MANIFEST, STATE_FILE))]
    val = directory / VAL_DIR
    if val.is_dir():
        found += [p for p in val.iterdir() if p.is_file() and (p.name.startswith(shards.SHARD_PREFIX) or p.name == shards.MANIFEST)]
    return found


def _describe_mismatch(old: dict, new: dict) -> str:
    if old.get("tokenizer_fingerprint") != new["tokenizer_fingerprint"]:
        return f"it holds shards of another tokenizer ({old.get('tokenizer_fingerprint')}, this one is {new['tokenizer_fingerprint']})"
    keys = [k for k in new if old.get(k) != new[k]]
    if keys == ["inputs"]:
        return "it was made from other input files (or they changed since: path, size or mtime differ)"
    return f"it was made with other settings ({', '.join(keys)} differ)"


def _check_output(cfg: PrepareConfig, identity: dict) -> str:
    """Decide, before any work, what to do with the output directory: 'fresh', 'overwrite', 'resume'
    or 'complete'; raise if it holds output this run must not touch."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--output {out}: exists and is not a directory")
    existing = _our_files(out)
    if not existing:
        return "fresh"
    state_path = out / STATE_FILE
    old = json.loads(state_path.read_text()) if state_path.is_file() else None
    if cfg.overwrite:
        return "overwrite"  # deleted once the tokenizer backend is settled, just before writing
    if old is None:
        if (out / shards.MANIFEST).is_file():
            m = shards.Manifest.load(out)
            if m.tokenizer_fingerprint != identity["tokenizer_fingerprint"]:
                raise PrepareError(f"--output {out}: it holds shards of another tokenizer ({m.tokenizer_fingerprint}, this one is {identity['tokenizer_fingerprint']}); pass --overwrite to replace them or choose another --output")
        raise PrepareError(f"--output {out}: it holds shard files this tool cannot resume (no {STATE_FILE}); pass --overwrite to replace them or choose another --output")
    if old != identity:
        raise PrepareError(f"--output {out}: {_describe_mismatch(old, identity)}; pass --overwrite to replace it or choose another --output")
    return "complete" if (out / shards.MANIFEST).is_file() else "resume"


def _complete_shards(directory: Path) -> list[dict]:
    """Metadata of the complete shards 0..k-1 of a directory; every other shard file is deleted."""
    metas = []
    while True:
        i = len(metas)
        mp_, bp, op = shards.meta_path(directory, i), shards.bin_path(directory, i), shards.offsets_path(directory, i)
        if not (mp_.is_file() and bp.is_file() and op.is_file()):
            break
        meta = json.loads(mp_.read_text())
        if bp.stat().st_size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize or "prepare" not in meta:
            break
        metas.append(meta)
    keep = {shards.shard_stem(i) for i in range(len(metas))}
    if directory.is_dir():
        for p in directory.iterdir():
            if p.is_file() and p.name.startswith(shards.SHARD_PREFIX) and p.name.split(".")[0] not in keep:
                p.unlink()
            elif p.is_file() and p.name.endswith(".tmp"):
                p.unlink()
    return metas


def _chunk_in_worker(spec: _Spec, *args) -> tuple[ChunkResult, np.ndarray]:
    """`_process_chunk` for `OrderedPool`: the tokens travel as raw bytes, the rest as the header."""
    res = _process_chunk(spec, *args)
    tokens, res.tokens = res.tokens, None
    return res, tokens


def _ordered_results(tasks: Iterator[tuple], spec: _Spec, pool: OrderedPool | None, work_here: bool = True) -> Iterator[tuple]:
    """Yield `(extra, ChunkResult)` for each `(extra, task_args)` in input order.

    Without a pool the blocks are tokenized here (one worker is one core: this one). With one, at
    most two blocks per worker are in flight, so memory does not depend on the input's size; with
    `work_here` this process tokenizes too whenever the next result is not ready (`pool_layout`).
    """
    if pool is None:
        for extra, args in tasks:
            yield extra, _process_chunk(spec, *args)
        return
    extras: deque = deque()

    def args_only():
        for extra, args in tasks:
            extras.append(extra)
            yield args

    for res, tokens in pool.imap(args_only(), work_here=work_here):
        res.tokens = tokens
        yield extras.popleft(), res


def _guard_sample(files: list[Path], cfg: PrepareConfig, budget: int = 1 << 20) -> tuple[list[str], list[str]]:
    """Documents (and their file:line) from the start of up to 8 input files spread over the input."""
    picks = sorted({round(i * (len(files) - 1) / 7) for i in range(8)}) if len(files) > 8 else range(len(files))
    texts, labels = [], []
    for fi in picks:
        first = next(readers.iter_blocks(files[fi], budget // len(picks)), None)
        if first is None:
            continue
        first_line, block, _ = first
        for line, text, _ in readers.load_block(block, cfg.text_field, head=256)[0]:
            if text is not None:
                texts.append(text)
                labels.append(f"{files[fi]}:{first_line + line}")
    return texts, labels


def _select_backend(cfg: PrepareConfig, files: list[Path], reference, log: Callable[[str], None]) -> tuple[object, dict]:
    """The encoder to use and what the manifest records about it.

    `fast` is used only when it gives HF's ids on a sample of this input and `ADVERSARIAL_TEXTS`;
    otherwise `auto` falls back to HF with a warning naming the first difference and `fast` stops.
    """
    if reference.kind == "sentencepiece":
        return reference, {"name": "sentencepiece", "version": _version("sentencepiece"), "requested": cfg.tokenizer_backend}
    hf = {"name": "tokenizers", "version": _version("tokenizers"), "requested": cfg.tokenizer_backend}
    if cfg.tokenizer_backend == "hf":
        return reference, hf
    try:
        fast = fast_beside(reference)
        sample, labels = _guard_sample(files, cfg)
        texts = ADVERSARIAL_TEXTS + sample
        labels = [f"adversarial text {i} {t[:24]!r}" for i, t in enumerate(ADVERSARIAL_TEXTS)] + labels
        difference = first_difference(fast, reference, texts, labels)
    except (FastBackendError, ImportError) as e:
        difference = str(e)
    if difference is None:
        return fast, {"name": "fastokens", "version": _version("fastokens"), "requested": cfg.tokenizer_backend, "checked_against_hf": len(texts)}
    if cfg.tokenizer_backend == "fast":
        raise PrepareError(f"--tokenizer-backend fast: fastokens does not match HF tokenizers: {difference}; use --tokenizer-backend hf (or auto)")
    log(f"warning: fastokens does not match HF tokenizers ({difference}); falling back to HF tokenizers (exact, slower)")
    return reference, {**hf, "fallback_reason": difference}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _tasks(files: list[Path], start: int, chunk_bytes: int) -> Iterator[tuple]:
    """`((file index, first line or None, disk bytes done), worker arguments)` for each block from
    input position `start` (see `readers.iter_blocks`)."""
    start_file, start_line = split_position(start)
    for fi in range(start_file, len(files)):
        for first_line, block, done in readers.iter_blocks(files[fi], chunk_bytes, max(start_line, 1) if fi == start_file else 1):
            yield (fi, first_line, done), (fi, block)


def prepare(cfg: PrepareConfig, log: Callable[[str], None] = print) -> PrepareResult:
    """Run data preparation; see the module docstring. Raises `PrepareError` for bad input or output."""
    cfg.validate()
    try:
        files = readers.resolve_inputs(list(cfg.inputs))
        for f in files:
            readers.check_input(f, cfg.text_field)
    except (OSError, ValueError) as e:
        raise PrepareError(str(e)) from e
    try:
        tok = load_tokenizer(cfg.tokenizer, cfg.eos_token)
    except (OSError, ValueError) as e:
        raise PrepareError(str(e)) from e
    out = Path(cfg.output)
    identity = _identity(cfg, files, tok)
    file_stats = [FileStats(str(f), f.stat().st_size) for f in files]
    mode = "fresh" if cfg.dry_run else _check_output(cfg, identity)
    if mode == "complete":
        m = shards.Manifest.load(out)
        log(f"{out}: already complete ({m.num_docs} documents, {m.num_tokens} tokens in {len(m.shards)} shards); nothing to do")
        return PrepareResult(out, file_stats, m.num_docs, m.num_tokens, 0, 0, len(m.shards), SkipLog.from_dict(m.extra["skipped"]), 0.0, 0, 0, already_complete=True)

    _single_threaded()
    threads_before = _thread_count()
    encoder, backend = _select_backend(cfg, files, tok, log)
    spec = _Spec(str(cfg.tokenizer), cfg.eos_token, "fast" if backend["name"] == "fastokens" else "hf", cfg.text_field, cfg.val_fraction)
    _loaded[spec] = encoder
    with contextlib.ExitStack() as stack:
        processes, work_here = pool_layout(cfg.workers)
        pool = stack.enter_context(OrderedPool(_chunk_in_worker, spec, processes, mp.get_context(_start_method(threads_before)))) if processes else None
        if mode == "overwrite":
            for p in _our_files(out):
                p.unlink()
        result = _run(cfg, files, tok, identity, file_stats, spec, pool, work_here, backend, log)
        result.layout = ("this process" if not processes else
                         f"{processes} worker process{'es' if processes > 1 else ''}" + ("" if not work_here else " and this one, whenever it would wait"))
        return result


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pool_layout(workers: int, cores: int | None = None) -> tuple[int, bool]:
    """How `--workers N` runs: (worker processes, whether this process tokenizes too).

    With a core to spare beyond N, N worker processes tokenize and this process only hands out
    blocks and writes and hashes the shards (a fifth to a third of a core at two workers), so the N
    workers never wait for it. Without one, this process is one of the N: N - 1 worker processes, and
    it tokenizes a block itself whenever the next result in order is not ready (`OrderedPool.imap`),
    so no core idles.
    """
    if workers == 1:
        return 0, True
    if (cores or usable_cores()) > workers:
        return workers, False
    return workers - 1, True


def _run(cfg: PrepareConfig, files: list[Path], tok, identity: dict, file_stats: list[FileStats], spec: _Spec, pool, work_here: bool, backend: dict, log: Callable[[str], None]) -> PrepareResult:
    """Resume or start the output, stream every block through the pool into the shards, write the manifests."""
    out = Path(cfg.output)
    splits: dict[str, _SplitWriter] = {}
    skiplog = SkipLog()
    start = 0
    resumed_from = None
    if not cfg.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        dirs = {"train": out} | ({"val": out / VAL_DIR} if cfg.val_fraction > 0 else {})
        resume_points = {}
        for name, d in dirs.items():
            d.mkdir(exist_ok=True)
            metas = _complete_shards(d)
            pos, state = 0, None
            if metas:
                pos = position(*metas[-1]["prepare"]["next_record"])
                state = metas[-1]["prepare"]["skipped"]
            resume_points[name] = (pos, state)
            splits[name] = _SplitWriter(d, cfg.shard_tokens, tok.vocab_size, tok.eos_id, len(metas), pos)
        start, state = min(resume_points.values(), key=lambda ps: ps[0])
        if state is not None:
            skiplog = SkipLog.from_dict(state)
        if start > 0:
            fi, line = split_position(start)
            resumed_from = f"{files[fi]}:{line}" if fi < len(files) else "the end of the input"
            log(f"resuming {out} from {resumed_from} (complete shards kept: " + ", ".join(f"{n} {s.next_index}" for n, s in splits.items()) + ")")
        atomic_write_json(out / STATE_FILE, identity)

    t0 = time.perf_counter()
    totals = {"docs": 0, "tokens": 0, "text_bytes": 0}
    disk_done = sum(s.bytes for s in file_stats[: split_position(start)[0]])
    bar = _progress_bar(sum(s.bytes for s in file_stats), disk_done, cfg.progress)
    reported = split_position(start)[0]
    next_line = 1  # the file line where the next block of the current file starts
    try:
        for (fi, first_line, consumed), res in _ordered_results(_tasks(files, start, cfg.chunk_bytes), spec, pool, work_here):
            while cfg.verbose and reported < fi:
                _log_file(log, file_stats[reported])
                reported += 1
            if first_line is not None:
                next_line = first_line
            res.at_line(next_line)
            next_line += res.n_lines
            _merge(res, files, file_stats[fi], splits, skiplog, cfg.strict)
            totals["docs"] += len(res.doc_lens)
            totals["tokens"] += len(res.tokens)
            totals["text_bytes"] += res.text_bytes
            if bar is not None:
                new_done = sum(s.bytes for s in file_stats[:fi]) + consumed
                bar.update(new_done - disk_done)
                disk_done = new_done
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{totals['docs'] / dt:,.0f} docs/s, {totals['tokens'] / dt / 1e6:,.2f}M tok/s, {totals['text_bytes'] / dt / 1e6:,.1f} MB/s text", refresh=False)
        end = position(len(files), 0)
        for s in splits.values():
            s.finish(end, skiplog.to_dict())
    except BaseException:
        for s in splits.values():
            s.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    while cfg.verbose and reported < len(files):
        _log_file(log, file_stats[reported])
        reported += 1
    seconds = time.perf_counter() - t0

    if cfg.dry_run:
        return PrepareResult(None, file_stats, totals["docs"], totals["tokens"], 0, 0, 0, skiplog, seconds, totals["text_bytes"], totals["tokens"], backend=backend["name"])

    manifests = {}
    for name in (["val"] if "val" in splits else []) + ["train"]:  # the top-level manifest last
        manifests[name] = _write_manifest(splits[name].directory, cfg, files, tok, skiplog, name, manifests.get("val"), backend)
    train, val = manifests["train"], manifests.get("val")
    return PrepareResult(
        out, file_stats, train.num_docs, train.num_tokens, val.num_docs if val else 0, val.num_tokens if val else 0,
        len(train.shards) + (len(val.shards) if val else 0), skiplog, seconds, totals["text_bytes"], totals["tokens"], resumed_from,
        backend=backend["name"],
    )


def _merge(res: ChunkResult, files: list[Path], stats: FileStats, splits: dict[str, _SplitWriter], skiplog: SkipLog, strict: bool) -> None:
    """Hand one block's documents to the split writers and count its skips, in input order."""
    if strict and res.skips:
        pos, reason = res.skips[0]
        fi, line = split_position(pos)
        raise PrepareError(f"{files[fi]}:{line}: {reason.replace('_', ' ')} (--strict stops at the first bad record)")
    stats.docs += len(res.doc_lens)
    stats.tokens += len(res.tokens)
    stats.skipped += len(res.skips)
    if splits:
        before = skiplog.copy()

        def state_at(pos: int) -> dict:
            # The skip log as it stood just before input position `pos` (within this block).
            s = before.copy()
            for p, reason in res.skips:
                if p < pos:
                    s.add(reason, _where(files, p))
            return s.to_dict()

        if res.is_val is None:
            splits["train"].add(res.tokens, res.doc_lens, res.positions, state_at)
        else:
            token_is_val = np.repeat(res.is_val, res.doc_lens)
            for name, doc_mask, tok_mask in (("train", ~res.is_val, ~token_is_val), ("val", res.is_val, token_is_val)):
                splits[name].add(res.tokens[tok_mask], res.doc_lens[doc_mask], res.positions[doc_mask], state_at)
    for p, reason in res.skips:
        skiplog.add(reason, _where(files, p))


def _where(files: list[Path], pos: int) -> str:
    fi, line = split_position(pos)
    return f"{files[fi]}:{line}"


def _write_manifest(directory: Path, cfg: PrepareConfig, files: list[Path], tok, skiplog: SkipLog, split: str, val: shards.Manifest | None, backend: dict) -> shards.Manifest:
    metas = [shards.ShardMeta.load(p.with_suffix(".json")) for p in shards.list_shards(directory)]
    extra = {
        "split": split,
        "tool": {"name": "olmo-ds prepare_data", "version": olmo_ds.__version__},
        "arguments": {
            "input": [str(i) for i in cfg.inputs],
            "tokenizer": str(cfg.tokenizer),
            "text_field": cfg.text_field,
            "shard_tokens": cfg.shard_tokens,
            "val_fraction": cfg.val_fraction,
            "eos_token": cfg.eos_token,
        },
        "inputs": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
        "skipped": skiplog.to_dict(),
        "pad_id": tok.pad_id,
        "tokenizer_backend": backend,
    }
    if val is not None:
        extra["val"] = {"dir": VAL_DIR, "num_docs": val.num_docs, "num_tokens": val.num_tokens, "shards": len(val.shards)}
    manifest = shards.Manifest(
        num_tokens=sum(m.num_tokens for m in metas),
        num_docs=sum(m.num_docs for m in metas),
        shards=[m.bin for m in metas],
        dtype=shards.dtype_for_vocab(tok.vocab_size).name,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer_fingerprint=tok.fingerprint,
        extra=extra,
    )
    manifest.save(directory)
    return manifest


def _progress_bar(total: int, initial: int, enabled: bool | None):
    from tqdm import tqdm

    disable = None if enabled is None else not enabled
    bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare", disable=disable, file=sys.stderr, dynamic_ncols=True)
    return None if bar.disable else bar


def _log_file(log: Callable[[str], None], s: FileStats) -> None:
    log(f"{s.path}: {s.docs:,} docs, {s.tokens:,} tokens, {s.skipped:,} skipped")


def format_summary(r: PrepareResult, dry_run: bool = False) -> str:
    """The table printed at the end of a run."""
    rows = []
    if dry_run:
        rows.append(("file", "docs", "tokens", "skipped"))
        rows += [(s.path, f"{s.docs:,}", f"{s.tokens:,}", f"{s.skipped:,}") for s in r.files]
        width = max(len(a) for a, *_ in rows)
        lines = [f"{a:<{width}}  {b:>12}  {c:>14}  {d:>8}" for a, b, c, d in rows]
        lines.append(f"{'total':<{width}}  {r.num_docs:>12,}  {r.num_tokens:>14,}  {sum(r.skipped.counts.values()):>8,}")
        lines.append("dry run: nothing written")
    else:
        lines = [f"output          {r.output}"]
        if r.resumed_from:
            lines.append(f"resumed from    {r.resumed_from}")
        lines += [
            f"input files     {len(r.files):,} ({sum(s.bytes for s in r.files) / 1e6:,.1f} MB on disk)",
            f"train           {r.num_docs:,} docs, {r.num_tokens:,} tokens",
        ]
        if r.val_docs or r.val_tokens:
            lines.append(f"val             {r.val_docs:,} docs, {r.val_tokens:,} tokens")
        lines.append(f"shards          {r.num_shards:,}")
    lines.append(f"tokenizer       {r.backend}" + (f", run by {r.layout}" if r.layout else ""))
    lines.append(f"skipped         {sum(r.skipped.counts.values()):,} records")
    for reason, n in sorted(r.skipped.counts.items()):
        lines.append(f"  {reason:<22}{n:>10,}   e.g. {', '.join(r.skipped.examples.get(reason, [])[:3])}")
    if r.seconds > 0:
        lines.append(f"time            {r.seconds:,.3f} s  ({r.run_tokens / r.seconds / 1e6:,.2f}M tokens/s, {r.text_bytes / r.seconds / 1e6:,.1f} MB/s of text)")
    return "\n".join(lines)
