"""Streaming readers for raw text corpora: JSON lines (plain, gzip, zstd) and plain text files.

Input order is part of the output contract (shards concatenate documents in input order), so
`resolve_inputs` expands files, directories and globs into one sorted, de-duplicated list.

Reading is split in two so that a worker pool can do the expensive half: `iter_chunks` (cheap,
sequential: decompress and cut the stream into blocks of whole lines) and `parse_chunk` (JSON
parsing and validation, in a worker). Neither holds more than one block (or, for `.txt`, one file)
in memory. A record that cannot become a document is returned as a `(line, reason)` skip, so a
long run counts bad input instead of dying on it (or stops on it with `--strict`).
"""

from __future__ import annotations

import glob
import gzip
import io
import os
from pathlib import Path
from typing import Iterator

import orjson

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd")
TEXT_SUFFIXES = (".txt",)
SUPPORTED = JSONL_SUFFIXES + TEXT_SUFFIXES

# Reasons a record is skipped (the keys of the manifest's `skipped` counts).
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_text_field"
NOT_A_STRING = "text_not_a_string"
INVALID_UTF8 = "invalid_utf8"
EMPTY = "empty_document"
SKIP_REASONS = (MALFORMED_JSON, MISSING_FIELD, NOT_A_STRING, INVALID_UTF8, EMPTY)

CHUNK_BYTES = 1 << 20


def is_supported(path: Path) -> bool:
    return path.name.endswith(SUPPORTED)


def is_text_file(path: Path) -> bool:
    return path.name.endswith(TEXT_SUFFIXES)


def resolve_inputs(specs: list[str]) -> list[Path]:
    """Files, directories (searched recursively for supported files) and globs → sorted file list.

    Raises with the offending spec when something names nothing, a file has an unsupported
    suffix or is unreadable, or the whole set is empty: all before any work starts.
    """
    files: set[Path] = set()
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and is_supported(p)]
            if not found:
                raise FileNotFoundError(f"{spec}: directory holds no supported input files ({', '.join(SUPPORTED)})")
            files.update(found)
        elif path.is_file():
            if not is_supported(path):
                raise ValueError(f"{spec}: unsupported input type (supported: {', '.join(SUPPORTED)})")
            files.add(path)
        elif glob.has_magic(spec):
            found = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file() and is_supported(Path(p))]
            if not found:
                raise FileNotFoundError(f"{spec}: glob matches no supported input files")
            files.update(found)
        else:
            raise FileNotFoundError(f"{spec}: no such file or directory")
    if not files:
        raise ValueError("no input files given")
    for f in files:
        if not os.access(f, os.R_OK):
            raise PermissionError(f"{f}: input file is not readable")
    # Sort on the absolute path string so the order never depends on how a path was spelled.
    return sorted((f.resolve() for f in files), key=str)


class _CountingReader(io.RawIOBase):
    """Wraps a file and counts the bytes read from it, i.e. the compressed progress."""

    def __init__(self, f):
        self._f = f
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._f.readinto(buffer)
        self.consumed += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def open_binary(path: Path) -> tuple[io.BufferedIOBase, _CountingReader]:
    """A binary stream of the decompressed content, and the counter of on-disk bytes consumed."""
    raw = _CountingReader(open(path, "rb", buffering=0))
    name = path.name
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=io.BufferedReader(raw, 1 << 20), mode="rb"), raw
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), 1 << 20), raw
    return io.BufferedReader(raw, 1 << 20), raw


def iter_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES, start_line: int = 1) -> Iterator[tuple[int, bytes, int]]:
    """Yield `(first_line, data, disk_bytes_consumed)`: blocks of whole lines of the decompressed file.

    A `.txt` file is one block (one document). Lines before `start_line` (1-based) are not
    yielded; resuming an interrupted run uses this.
    """
    path = Path(path)
    stream, counter = open_binary(path)
    with stream:
        if is_text_file(path):
            data = stream.read()
            if start_line <= 1:
                yield 1, data, counter.consumed
            return
        line = 1  # number of the first line in `pending`
        pending = b""
        while True:
            block = stream.read(chunk_bytes)
            if not block:
                break
            data = pending + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a block: keep reading until it ends
                pending = data
                continue
            data, pending = data[:cut], data[cut:]
            n_lines = data.count(b"\n")
            if line + n_lines <= start_line:
                line += n_lines
                continue
            if line < start_line:
                data = data[_offset_of_line(data, start_line - line):]
                line = start_line
                n_lines = data.count(b"\n")
            yield line, data, counter.consumed
            line += n_lines
        if pending and line >= start_line:
            yield line, pending, counter.consumed


def _offset_of_line(data: bytes, n: int) -> int:
    """Byte offset of the start of line n (0-based) within data."""
    pos = 0
    for _ in range(n):
        pos = data.index(b"\n", pos) + 1
    return pos


def parse_chunk(data: bytes, first_line: int, text_file: bool, text_field: str = "text") -> list[tuple[int, str | None, str | None]]:
    """Parse one block into `(line, text, None)` for each document and `(line, None, reason)` for each skip."""
    if text_file:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return [(1, None, INVALID_UTF8)]
        return [(1, text, None) if text.strip() else (1, None, EMPTY)]
    out = []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue  # blank lines (and the empty tail after the last newline) are not records
        lineno = first_line + i
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            # Invalid UTF-8 bytes and escaped lone surrogates both make text that cannot be
            # UTF-8 encoded; they are an encoding problem, not a JSON syntax one.
            out.append((lineno, None, INVALID_UTF8 if "surrogate" in str(e) or not _is_utf8(line) else MALFORMED_JSON))
            continue
        if not isinstance(record, dict) or text_field not in record:
            out.append((lineno, None, MISSING_FIELD))
            continue
        text = record[text_field]
        if not isinstance(text, str):
            out.append((lineno, None, NOT_A_STRING))
        elif not text.strip():
            out.append((lineno, None, EMPTY))
        else:
            out.append((lineno, text, None))
    return out


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, in order, silently passing over records that are not documents."""
    path = Path(path)
    for first_line, data, _ in iter_chunks(path):
        for _, text, _ in parse_chunk(data, first_line, is_text_file(path), text_field):
            if text is not None:
                yield text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
