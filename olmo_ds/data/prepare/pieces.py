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
  of a shard becomes a `ShardJob` at once: the ranges of the piece, its documents' lengths, and its
  place in the shard (the tokens and documents of the shard's earlier parts), known at the cut; the
  part that closes a shard carries its resume point, once the document after the shard is known.
- Any free worker writes a part at its place (`write_part`, `shards.ShardInParts`: temporary names,
  the data handed to the disk as it is written, each block read back and compared), before it
  tokenizes again; parts of one shard are written in any order, on several workers at once. Then
  the pieces no part needs any more are deleted.
- The sha256 of a shard needs its bytes in order, so per shard one thread of the main process reads
  back the written prefix as it grows (`Assembly`, `validate.ReadBack`), and after the last part
  closes the shard (fsync, rename, metadata last) and checks it (`validate.check_shard`). Hashing is
  a shard's one serial step, and it follows the parts as they land. (Before, all parts of a shard
  went in order to one worker that kept its sha256 going; a shard filled by files that finished
  together queued behind it, and that backlog was the run's tail on many cores.)

So the main process orders, hashes and deletes; workers read, tokenize and write. A shard is written
while it fills: when the last file is tokenized, what is left is that file's share, the reading of
it, and the closing, not whole shards. A shard's ids are written twice (piece, then shard), spread
over the workers.

What makes the output byte-identical to a one-worker run (every shard's `.bin`, `.offsets.npy` and
`.json`, the manifests, the validation split, `.prepare.json`): the documents and their order are
the same (files in input order, lines in file order, the same per-block tokenizing code); shard
boundaries come from the same `ShardCutter` over the same lengths; a shard's resume point is the
same function of the input (the position of the next document, the skips and notes before it,
`prepare._logs_before`); and nothing written records the mode or the worker count.

Kill safety: shards are finished in any order, but a shard is complete only once its `.json`
exists, and a rerun keeps only the complete shards 0..k-1 (`output.complete_shards` deletes
a complete shard after a gap), deletes `.prepare-pieces`, and reads the input again from just after
shard k-1's last document, in either mode.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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
    """One part of a shard: ranges of piece files, written at the part's place in the shard (`write_part`) by
    whichever worker is free. The part that closes the shard carries `extra`, its resume point."""

    shard: shards.ShardInParts
    part: int  # the shard's parts 0, 1, ... lie in the file in this order
    at_token: int  # the tokens of the shard before this part
    at_doc: int  # its documents before this part
    segments: list[tuple[str, int, int, np.ndarray]]  # (piece file, first id, end id, its documents' lengths)
    extra: dict | None  # the resume point, stored in the shard's metadata, on the part that closes it; None: more parts follow
    trained: int = 0  # conversations: the loss mask's ones in this part (set by the worker that writes it)
    top: int = -1  # the part's largest id and EOS count (set by the worker that writes it: `ReadBack.take_ids`)
    eos: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return str(self.shard.directory), self.shard.index

    @property
    def tokens(self) -> int:
        return sum(end - first for _, first, end, _ in self.segments)

    @property
    def docs(self) -> int:
        return sum(len(lens) for *_, lens in self.segments)

    @property
    def pieces(self) -> list[str]:
        return [s[0] for s in self.segments]


def write_part(job: ShardJob) -> ShardJob:
    """In a worker: copy the part's piece ranges to its place in the shard's files (`ShardInParts.write`), in blocks
    of whole documents, so a worker's memory stays bounded."""
    shard, at_token, at_doc = job.shard, job.at_token, job.at_doc
    for path, first, end, lens in job.segments:
        ids = np.memmap(path, dtype=shard.dtype, mode="r", offset=first * shard.dtype.itemsize, shape=(end - first,))
        mask = np.memmap(mask_piece(path), dtype=np.bool_, mode="r", offset=first, shape=(end - first,)) if shard.masked else None
        ends = np.cumsum(lens, dtype=np.int64)
        d = 0
        while d < len(lens):
            e = max(int(np.searchsorted(ends, (ends[d - 1] if d else 0) + BLOCK_TOKENS, side="right")), d + 1)
            lo, hi = (ends[d - 1] if d else 0), ends[e - 1]
            top, eos = shard.write(at_token + int(lo), at_doc + d, ids[lo:hi], lens[d:e], None if mask is None else mask[lo:hi])
            job.top, job.eos = max(job.top, top), job.eos + eos
            if mask is not None:
                job.trained += int(np.count_nonzero(mask[lo:hi]))
            d = e
        at_token, at_doc = at_token + int(ends[-1]) if len(ends) else at_token, at_doc + len(lens)
        del ids, mask
    job.segments = [(path, first, end, np.zeros(0, np.int64)) for path, first, end, _ in job.segments]  # the lengths need not travel back
    return job


class _Assembling:
    """A shard of `Assembly` from its first part to its close: which parts are written, how far the reader has read."""

    def __init__(self, shard: shards.ShardInParts):
        self.shard = shard
        self.ends: list[int] = []  # per part, in order: the shard's tokens up to its end
        self.written: set[int] = set()
        self.read = 0  # parts read back so far (all before this one)
        self.read_back = ReadBack(shard.dtype, shard.eos_id, ids=False)
        self.mask_read_back = ReadBack(np.uint8, 0, ids=False) if shard.masked else None  # its sha256 (the mask: one byte per token)
        self.trained = 0
        self.closing: ShardJob | None = None  # the part that closes it, once made
        self.reading = False  # a thread is reading it now
        self.lock = threading.Lock()


class Assembly:
    """The shards being written in parts, in the coordinating process (whole-file mode).

    Parts go to any free worker (`write_part`) and finish in any order; the shard's sha256 needs its bytes in order.
    So, per shard, one thread here reads back the written prefix as it grows (`validate.ReadBack`: the sha256 of the
    bytes as read; the largest id and EOS count come from the workers, who compared the ids they wrote with the
    file's), and once every part is written and read it closes the shard (`ShardInParts.close`) and checks it
    (`check_shard`, with that reading: the check reads only what a whole read would add). Hashing is the one serial
    step of a shard; it follows the parts as they land, so when the last file is tokenized little of any shard is
    left to read. (Threads: the reads and hashes release the GIL.)"""

    def __init__(self, check: tuple[ShardRules, str] | None, threads: int = 8):
        self.check = check
        self.shards: dict[tuple[str, int], _Assembling] = {}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-reader")
        self.error: BaseException | None = None

    def made(self, jobs: list[ShardJob]) -> list[ShardJob]:
        """Register parts as they are cut (a shard's files are made with its first part); returns those to write
        (a closing part with no ids needs no worker: it counts as written at once)."""
        to_write = []
        for job in jobs:
            if job.part == 0:
                job.shard.create()
                self.shards[job.key] = _Assembling(job.shard)
            state = self.shards[job.key]
            state.ends.append(job.at_token + job.tokens)
            if job.extra is not None:
                state.closing = job
            if job.segments:
                to_write.append(job)
            else:
                self.written(job)
        return to_write

    def written(self, job: ShardJob) -> None:
        """A worker has written `job`: read on (in a thread of this pool)."""
        state = self.shards[job.key]
        with state.lock:
            state.written.add(job.part)
            state.trained += job.trained
            state.read_back.take_ids(job.top, job.eos)
            if state.reading:
                return  # the running reader sees it before it stops
            state.reading = True
        self.pool.submit(self._follow, state)

    def _follow(self, state: _Assembling) -> None:
        """Read the shard's parts in order while the next is written; close it after its last."""
        try:
            while True:
                with state.lock:
                    k = state.read
                    if k not in state.written:
                        state.reading = False
                        return
                self._read_part(state, k)
                state.read = k + 1
                if state.closing is not None and state.read == state.closing.part + 1:
                    self._close(state)
                    return
        except BaseException as e:  # raised in the coordinating loop (`raise_error`)
            self.error = self.error or e

    def _read_part(self, state: _Assembling, k: int) -> None:
        """Read part k of the shard back (a file shorter than its parts make is refused when the shard closes)."""
        shard, end = state.shard, state.ends[k]
        state.read_back.read(shard.bin_tmp, end * shard.dtype.itemsize)
        if state.mask_read_back is not None:
            state.mask_read_back.read(shard.mask_tmp, end)

    def _close(self, state: _Assembling) -> None:
        shard, job = state.shard, state.closing
        digest, top, _ = state.read_back.reading()
        mask_digest = state.mask_read_back.reading()[0].removeprefix("sha256:") if state.mask_read_back is not None else None
        shard.close(job.at_token + job.tokens, job.at_doc + job.docs, digest.removeprefix("sha256:"), top, mask_digest, state.trained, job.extra)
        if self.check is not None:
            check_shard(shard.directory, shards.bin_path(shard.directory, shard.index).name, *self.check, read_back=state.read_back)
        del self.shards[job.key]

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """Wait for every shard to be read and closed; raise what went wrong in a reader."""
        self.pool.shutdown(wait=True)
        self.raise_error()
        if self.shards:
            raise RuntimeError(f"shards left open once every part was written: {sorted(self.shards)}")

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class PieceSplit:
    """One split's shards in whole-file mode: the documents of each piece, in input order, cut into
    shards by the rule `ShardedWriter` writes by, skipping documents already in complete shards.
    Each piece's share of a shard is a `ShardJob` at once, placed after the shard's earlier parts, so a
    shard is written while it fills, and what is left when the last file is tokenized is that file's
    share and the closing."""

    def __init__(self, directory: Path, shard_tokens: int, vocab_size: int, eos_id: int, next_index: int, resume_pos: int, masked: bool = False,
                 preference: bool = False):
        self.directory = directory
        self.masked = masked
        self.preference = preference  # cut only between pairs (`ShardCutter.feed_pairs`)
        self.cutter = shards.ShardCutter(shard_tokens)
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.next_index = next_index
        self.resume_pos = resume_pos  # documents before this input position are already in complete shards
        self.open: list[tuple[str, int, int, np.ndarray]] = []  # segments of the shard being filled, not yet in a job
        self.parts = self.tokens = self.docs = 0  # of the shard `next_index` so far (in jobs made)

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
        return [self._part(resume_point(end, state))] if self.parts or self.open else []

    def _part(self, extra: dict | None) -> ShardJob:
        """The open segments as the next part of shard `next_index`; `extra`: it closes with them."""
        shard = shards.ShardInParts(self.directory, self.next_index, vocab_size=self.vocab_size, eos_id=self.eos_id, masked=self.masked,
                                    preference=self.preference)
        job = ShardJob(shard, self.parts, self.tokens, self.docs, self.open, extra)
        self.open = []
        self.parts, self.tokens, self.docs = (0, 0, 0) if extra is not None else (self.parts + 1, self.tokens + job.tokens, self.docs + job.docs)
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
