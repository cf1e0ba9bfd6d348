"""Whole-file mode of data preparation: workers tokenize whole files into pieces, and the shards are
cut from the pieces exactly where one process would cut them.

Why: handing out 1 MiB blocks from one process that also decompresses every compressed file (in
order: a stream cannot be split) and writes and hashes every shard caps the speed-up at a few
workers. With many input files there is a unit of work that needs none of that: the file.

- A worker takes a `Task` (one file, or several consecutive small ones), decompresses, parses and
  tokenizes it block by block and appends each split's ids to its own piece file
  (`OUTPUT/.prepare-pieces/piece-NNNNNN.{train,val}.bin`, no header). It sends back only the
  documents' lengths, their input positions, the skips and the special-token notes (`PieceResult`).
- The main process takes the results in input order and cuts each split's documents into shards
  with `shards.ShardCutter`, the rule `ShardedWriter` writes by (`PieceSplit`). Each piece's share
  of a shard becomes a `ShardJob` at once (the ranges of the piece, its documents' lengths; the
  shard's resume point on the part that closes it, once the document after the shard is known).
  All parts of a shard go, in order, to the one worker that holds its `shards.ShardWriter`
  (temporary names, sha256 kept going between parts, the data handed to the disk as it is written,
  fsync, rename, metadata last); a worker writes its queued parts before it tokenizes again, and a
  new shard goes to an idle worker. Then the pieces no part needs any more are deleted. So the main
  process orders and deletes; workers read, tokenize and write. A shard is written while it fills:
  when the last file is tokenized, what is left is that file's share and the closing, not whole
  shards. A shard's ids are written twice (piece, then shard), spread over the workers.

What makes the output byte-identical to a one-worker run (every shard's `.bin`, `.offsets.npy` and
`.json`, the manifests, the validation split, `.prepare.json`): the documents and their order are
the same (files in input order, lines in file order, the same per-block tokenizing code); shard
boundaries come from the same `ShardCutter` over the same lengths; a shard's resume point is the
same function of the input (the position of the next document, the skips and notes before it,
`prepare._logs_before`); and nothing written records the mode or the worker count.

Kill safety: workers finish shards in any order, but a shard is complete only once its `.json`
exists, and a rerun keeps only the complete shards 0..k-1 (`output.complete_shards` deletes
a complete shard after a gap), deletes `.prepare-pieces`, and reads the input again from just after
shard k-1's last document, in either mode.
"""

from __future__ import annotations

import shutil
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Container

import numpy as np

from olmo_ds.data import shards
from olmo_ds.data.prepare.output import resume_point, split_position
from olmo_ds.data.validate import ReadBack, ShardRules, check_shard

PIECES_DIR = ".prepare-pieces"
GROUP_BYTES = 4 << 20  # files smaller than this (on disk) share a task with their neighbours
BLOCK_TOKENS = 1 << 22  # ids copied from a piece per step: a worker's memory stays bounded


@dataclass(frozen=True)
class Task:
    """Files to tokenize whole, in order; the first from line `start_line` (a resume point)."""

    index: int
    files: tuple[tuple[int, str], ...]  # (index in the input list, path)
    start_line: int
    pieces: str | None  # where the piece files go; None in a dry run (ids are counted, not kept)
    chunk_bytes: int
    train_from: int = 0  # train documents before this input position are in complete shards: not tokenized (`worker.process_chunk`)

    def piece(self, split: str) -> str:
        return str(Path(self.pieces) / f"piece-{self.index:06d}.{split}.bin")


def mask_piece(piece: str) -> str:
    """The loss mask beside a piece of conversations (`--format chat`): one byte per id of the piece."""
    return piece[: -len(".bin")] + ".mask"


def plan_tasks(files: list[Path], start: int, end_file: int, workers: int, chunk_bytes: int, pieces: Path | None, train_from: int = 0) -> list[Task]:
    """Tasks covering the input from position `start` to the end of file `end_file - 1`:
    consecutive files grouped until a task holds `GROUP_BYTES` on disk (fewer when the input is
    small, so that every worker gets several tasks)."""
    start_file, start_line = split_position(start)
    sizes = {fi: files[fi].stat().st_size for fi in range(start_file, end_file)}
    target = min(GROUP_BYTES, max(sum(sizes.values()) // (8 * workers), 1))
    tasks, group, size = [], [], 0
    for fi in range(start_file, end_file):
        group.append((fi, str(files[fi])))
        size += sizes[fi]
        if size >= target or fi == end_file - 1:
            first = start_line if group[0][0] == start_file else 1
            tasks.append(Task(len(tasks), tuple(group), max(first, 1), str(pieces) if pieces else None, chunk_bytes, train_from))
            group, size = [], 0
    return tasks


@dataclass
class PieceResult:
    """What a worker sends back for a task; the ids themselves are in the task's piece files."""

    doc_lens: np.ndarray  # int64 tokens per document, EOS included, in input order
    positions: np.ndarray  # int64 input position (`output.position`) of each document
    is_val: np.ndarray | None  # bool per document, when there is a validation split
    special_at: np.ndarray  # int64 input positions of the documents whose text holds a special token's text
    skips: list[tuple[int, str]]  # (input position, reason)
    text_bytes: int
    files: list[tuple[int, int, int, int]]  # per file: (index, documents, tokens, skipped records)
    notes: list[tuple[int, str]] = field(default_factory=list)  # (input position, reason) of documents kept but noted


@dataclass
class ShardJob:
    """The next part of one shard, written from ranges of piece files by the worker that holds the
    shard's writer (`write_shard_job`): the first part opens the shard, the last (`extra` given) closes it."""

    directory: str
    index: int
    vocab_size: int
    eos_id: int
    segments: list[tuple[str, int, int, np.ndarray]]  # (piece file, first id, end id, its documents' lengths)
    extra: dict | None  # the resume point, stored in the shard's metadata, on the part that closes it; None: more parts follow
    masked: bool = False  # conversations: each piece has its loss mask beside it (`mask_piece`)
    preference: bool = False  # preference pairs: the shard's documents are (chosen, rejected) pairs
    check: tuple[ShardRules, str] | None = None  # (rules, why inner EOS is allowed): the worker that closes the shard checks it

    @property
    def shard(self) -> tuple[str, int]:
        return self.directory, self.index

    @property
    def pieces(self) -> list[str]:
        return [s[0] for s in self.segments]


class ShardQueues:
    """Which worker writes which part of a shard, in whole-file mode. A shard's parts go, in order,
    to the one worker that holds its writer (it keeps the shard's sha256 going between parts); a
    new shard goes to an idle worker if there is one, else to the least loaded."""

    def __init__(self, workers: int):
        self.parts: list[deque[ShardJob]] = [deque() for _ in range(workers)]  # each worker's parts to write, in order
        self.writer_of: dict[tuple[str, int], int] = {}  # open shard -> the worker that holds its writer

    def add(self, jobs: list[ShardJob], busy: Container[int]) -> None:
        """Queue `jobs` in order; `busy`: the workers running a task now."""
        for job in jobs:
            w = self.writer_of.pop(job.shard, None)
            if w is None:
                w = min(range(len(self.parts)), key=lambda i: (i in busy, len(self.parts[i])))
            if job.extra is None:
                self.writer_of[job.shard] = w
            self.parts[w].append(job)

    def keeps_free(self, worker: int, files_left: int) -> bool:
        """Whether `worker` should take no new file now: in the last round (no more files left than the workers that
        hold no open shard), a worker holding one writes that shard's parts as the last files are cut, so the shard
        closes right after the last file instead of after a backlog of parts queued while its writer tokenized."""
        holders = set(self.writer_of.values())
        return worker in holders and files_left <= len(self.parts) - len(holders)

    def next_for(self, worker: int) -> ShardJob | None:
        """The next part `worker` is to write, if any."""
        return self.parts[worker].popleft() if self.parts[worker] else None

    def __bool__(self) -> bool:
        """Whether any part waits to be written."""
        return any(self.parts)


_writers: dict[tuple[str, int], tuple[shards.ShardWriter, ReadBack]] = {}  # in a worker: the shards it has open, between their parts


def write_shard_job(job: ShardJob) -> ShardJob:
    """Append the part's piece ranges to its shard through `ShardWriter` (opened by the first part,
    kept open in this worker for the next), in blocks of whole documents; close it on the last part.
    Each part is read back from the file just after it is written (`ReadBack`), so the shard's check on
    its last part reads only what that part wrote, not the whole shard again."""
    if job.shard not in _writers:
        writer = shards.ShardWriter(Path(job.directory), job.index, vocab_size=job.vocab_size, eos_id=job.eos_id, masked=job.masked,
                                    preference=job.preference)
        _writers[job.shard] = writer, ReadBack(writer.dtype, job.eos_id)
    writer, read_back = _writers.pop(job.shard)
    try:
        for path, first, end, lens in job.segments:
            ids = np.memmap(path, dtype=writer.dtype, mode="r", offset=first * writer.dtype.itemsize, shape=(end - first,))
            mask = np.memmap(mask_piece(path), dtype=np.bool_, mode="r", offset=first, shape=(end - first,)) if job.masked else None
            ends = np.cumsum(lens, dtype=np.int64)
            d = 0
            while d < len(lens):
                e = max(int(np.searchsorted(ends, (ends[d - 1] if d else 0) + BLOCK_TOKENS, side="right")), d + 1)
                lo, hi = (ends[d - 1] if d else 0), ends[e - 1]
                writer.append(ids[lo:hi], lens[d:e], None if mask is None else mask[lo:hi])
                d = e
            del ids, mask
        if job.check is not None:
            read_back.read(*writer.flushed_bin())  # while this part's bytes are in the page cache
        if job.extra is None:
            _writers[job.shard] = writer, read_back
        else:
            writer.close(job.extra)
    except BaseException:
        writer.abort()
        raise
    if job.extra is not None and job.check is not None:
        check_shard(Path(job.directory), shards.bin_path(Path(job.directory), job.index).name, *job.check, read_back=read_back)
    job.segments = [(path, first, end, np.zeros(0, np.int64)) for path, first, end, _ in job.segments]  # the lengths need not travel back
    return job


class PieceSplit:
    """One split's shards in whole-file mode: the documents of each piece, in input order, cut into
    shards by the rule `ShardedWriter` writes by, skipping documents already in complete shards.
    Each piece's share of a shard is a `ShardJob` at once, so a shard is written while it fills,
    and what is left when the last file is tokenized is that file's share and the closing."""

    def __init__(self, directory: Path, shard_tokens: int, vocab_size: int, eos_id: int, next_index: int, resume_pos: int, masked: bool = False,
                 preference: bool = False, check: tuple[ShardRules, str] | None = None):
        self.directory = directory
        self.masked = masked
        self.check = check
        self.preference = preference  # cut only between pairs (`ShardCutter.feed_pairs`)
        self.cutter = shards.ShardCutter(shard_tokens)
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.next_index = next_index
        self.resume_pos = resume_pos  # documents before this input position are already in complete shards
        self.open: list[tuple[str, int, int, np.ndarray]] = []  # segments of the shard being filled, not yet in a job
        self.opened = False  # the shard `next_index` has had a part

    def add(self, piece: str, lens: np.ndarray, positions: np.ndarray, state_at: Callable[[int], dict]) -> list[ShardJob]:
        """The piece's documents (all of this split in the task, in order) → the parts of the shards
        they go to, in order: those they complete, then their share of the shard left open."""
        first = int(np.searchsorted(positions, self.resume_pos, side="left"))  # positions increase
        ends = np.cumsum(lens, dtype=np.int64)
        base = int(ends[first - 1]) if first else 0
        lens, positions, ends = lens[first:], positions[first:], ends[first:]
        jobs, start = [], 0
        for k in [*(self.cutter.feed_pairs(lens) if self.preference else self.cutter.feed(lens)), len(lens)]:
            if k > start:
                self.open.append((piece, int(ends[start - 1]) if start else base, int(ends[k - 1]), lens[start:k]))
            if k < len(lens):
                jobs.append(self._part(resume_point(int(positions[k]), state_at(int(positions[k])))))
            start = k
        return jobs + ([self._part(None)] if self.open else [])

    def finish(self, end: int, state: dict) -> list[ShardJob]:
        """The last, partly filled shard's closing (as `ShardedWriter.finish`)."""
        return [self._part(resume_point(end, state))] if self.opened or self.open else []

    def _part(self, extra: dict | None) -> ShardJob:
        """The open segments as the next part of shard `next_index`; `extra`: it closes with them."""
        job = ShardJob(str(self.directory), self.next_index, self.vocab_size, self.eos_id, self.open, extra, self.masked, self.preference, self.check)
        self.open = []
        self.opened = extra is None
        self.next_index += extra is not None
        return job


def _unlink_piece(piece: str) -> None:
    Path(piece).unlink(missing_ok=True)
    Path(mask_piece(piece)).unlink(missing_ok=True)


class Pieces:
    """The piece files in `directory` and how many planned shards still read each; a piece is
    deleted as soon as its documents are all cut and none does."""

    def __init__(self, directory: Path):
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)  # a killed run's: never reused
        directory.mkdir(parents=True)
        self.readers: Counter = Counter()

    def planned(self, task: Task, jobs: list[ShardJob]) -> None:
        """After a task's documents were cut: count the segments made of its pieces (in the jobs
        made now; each is one reader), and delete a piece nobody reads."""
        mine = {task.piece("train"), task.piece("val")}
        self.readers.update(seg[0] for job in jobs for seg in job.segments if seg[0] in mine)
        for piece in mine:
            if self.readers[piece] == 0:
                _unlink_piece(piece)

    def written(self, job: ShardJob) -> None:
        self.readers.subtract(job.pieces)
        for piece in set(job.pieces):
            if self.readers[piece] <= 0:
                _unlink_piece(piece)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
