"""Streaming readers for raw text corpora: JSON lines (plain, gzip, zstd), plain text files and
Parquet (with pyarrow, an optional dependency).

Input order is part of the output contract (shards concatenate documents in input order), so
`resolve_inputs` expands files, directories and globs into one sorted, de-duplicated list.

Reading is split in two so that a worker pool can do the expensive half: `iter_blocks` (cheap, in
the process that hands out work) describes a file as blocks, and `load_block` (in a worker) reads,
parses and validates one. An uncompressed file is cut into byte ranges of whole lines without being
read (`iter_ranges`: a seek and a short read per block) and each worker reads its own range, so the
input never passes through the coordinating process; a Parquet file's blocks are its row groups,
also read by the workers. A compressed stream can only be decompressed in order, so it is read and
cut into blocks of whole lines by the coordinating process (`iter_chunks`). Nothing holds more than
one block (a `.txt` file, a Parquet row group) in memory.

Records are numbered by line (JSON lines; a Parquet file's row, from 1; a `.txt` file is line 1),
so every skipped record can be reported as `file:line`. A record that cannot become a document is returned as a `(line, reason)` skip, so a
long run counts bad input instead of dying on it (or stops on it with `--strict`).
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = JSONL_SUFFIXES + TEXT_SUFFIXES + PARQUET_SUFFIXES

# Reasons a record is skipped (the keys of the manifest's `skipped` counts).
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_text_field"
NOT_A_STRING = "text_not_a_string"
INVALID_UTF8 = "invalid_utf8"
EMPTY = "empty_document"
SKIP_REASONS = (MALFORMED_JSON, MISSING_FIELD, NOT_A_STRING, INVALID_UTF8, EMPTY)
MISSING_MESSAGES = "missing_messages"  # a conversation record (`--format chat`) without its `messages` field
CHAT_FIELD = "messages"  # where a conversation record keeps its turns (open-instruct / Tulu 3 SFT data)
PREFERENCE_FIELDS = ("chosen", "rejected")  # where a preference record (`--format preference`) keeps its two conversations
NOT_AN_OBJECT = "not_an_object"  # a preference line that parses as JSON but is no object
MISSING_SIDE = {"chosen": "missing_chosen", "rejected": "missing_rejected"}

CHUNK_BYTES = 1 << 20


def is_supported(path: Path) -> bool:
    return path.name.endswith(SUPPORTED)


def is_text_file(path: Path) -> bool:
    return path.name.endswith(TEXT_SUFFIXES)


def is_compressed(path: Path) -> bool:
    return path.name.endswith((".gz", ".zst", ".zstd"))


def is_parquet(path: Path) -> bool:
    return path.name.endswith(PARQUET_SUFFIXES)


def _pyarrow_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow, which is not installed: pip install pyarrow (or pip install -e '.[parquet]')") from None
    return pq


def check_input(path: Path, text_field: str, chat: bool = False, preference: bool = False) -> None:
    """Checks that need the text field, done for every file before any work: a Parquet file must be
    readable and hold `text_field` as a string column (`chat`: a `messages` list column; `preference`:
    `chosen` and `rejected` list columns)."""
    if not is_parquet(path):
        if preference and is_text_file(path):
            raise ValueError(f"{path}: a .txt file holds no preference pairs; --format preference reads JSON lines or Parquet with "
                             f"{' and '.join(map(repr, PREFERENCE_FIELDS))} fields")
        if chat and is_text_file(path):
            raise ValueError(f"{path}: a .txt file holds no conversations; --format chat reads JSON lines or Parquet with a {CHAT_FIELD!r} field")
        return
    pq = _pyarrow_parquet(path)
    import pyarrow as pa

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    if preference:
        for name in PREFERENCE_FIELDS:
            if name not in schema.names:
                raise ValueError(f"{path}: no column {name!r} (columns: {', '.join(schema.names)}); --format preference reads pairs from "
                                 f"{' and '.join(map(repr, PREFERENCE_FIELDS))}")
            kind = schema.field(name).type
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                raise ValueError(f"{path}: column {name!r} holds {kind}, not lists of messages")
        return
    if chat:
        if CHAT_FIELD not in schema.names:
            raise ValueError(f"{path}: no column {CHAT_FIELD!r} (columns: {', '.join(schema.names)}); --format chat reads conversations from it")
        kind = schema.field(CHAT_FIELD).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise ValueError(f"{path}: column {CHAT_FIELD!r} holds {kind}, not lists of messages")
        return
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); choose one with --text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {text_field!r} holds {kind}, not strings")


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
        if is_parquet(f):
            _pyarrow_parquet(f)
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


class CorruptInputError(ValueError):
    """A compressed input file that cannot be decompressed to its end (truncated or damaged)."""


class _ZstdFrames(io.RawIOBase):
    """The decompressed content of every zstd frame in `raw`, in order.

    `zstandard`'s own stream reader ends quietly where a truncated file ends, which would drop the
    rest of a document collection without a word; this one raises EOFError when the input stops
    inside a frame.
    """

    def __init__(self, raw, read_size: int = 1 << 18):
        import zstandard

        self._raw, self._read_size = raw, read_size
        self._dctx = zstandard.ZstdDecompressor()
        self._d = self._dctx.decompressobj()
        self._in_frame = False
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._raw.read(self._read_size)
            if not data:
                if self._in_frame:
                    raise EOFError("zstd: compressed file ended before the end of its last frame")
                return 0
            parts = []
            while data:  # a frame may end inside this read and the next one begin
                self._in_frame = True
                parts.append(self._d.decompress(data))
                data = b""
                if self._d.eof:
                    data = self._d.unused_data
                    self._d, self._in_frame = self._dctx.decompressobj(), False
            self._out, self._pos = b"".join(parts), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = memoryview(self._out)[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _gzip_reader(raw) -> io.BufferedIOBase:
    """python-isal's gzip reader (ISA-L inflate, ~3x the standard library's speed) when installed."""
    try:
        from isal import igzip
    except ImportError:
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return igzip.IGzipFile(fileobj=raw, mode="rb")


def _decompress_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    for module, name in (("isal.isal_zlib", "error"), ("zstandard", "ZstdError")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except ImportError:
            pass
    return tuple(errors)


def open_binary(path: Path) -> tuple[io.BufferedIOBase, _CountingReader]:
    """A binary stream of the decompressed content, and the counter of on-disk bytes consumed."""
    raw = _CountingReader(open(path, "rb", buffering=0))
    name = path.name
    if name.endswith(".gz"):
        return _gzip_reader(io.BufferedReader(raw, 1 << 20)), raw
    if name.endswith((".zst", ".zstd")):
        return io.BufferedReader(_ZstdFrames(raw), 1 << 20), raw
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
        errors = _decompress_errors() if is_compressed(path) else ()
        while True:
            try:
                block = stream.read(chunk_bytes)
            except errors as e:
                whole = _whole_lines_before_damage(path, errors)
                raise CorruptInputError(
                    f"{path}: cannot decompress past line {whole:,} (lines 1-{whole:,} are whole; "
                    f"{counter.consumed:,} of {path.stat().st_size:,} bytes on disk read): {type(e).__name__}: {e}. "
                    "The file is truncated or damaged; replace it (or leave it out) and run again"
                ) from e
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


def _whole_lines_before_damage(path: Path, errors: tuple[type[BaseException], ...]) -> int:
    """The number of whole lines of a damaged compressed file, read again up to the damage (on the
    error path only) with readers that hand out every byte they can decompress before they fail:
    the standard library's gzip, our zstd frames. ISA-L's gzip reader fails a whole read, so the
    lines decompressed in it would not be counted (a block of 1 MiB: often every line of the file)."""
    raw = open(path, "rb")
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else io.BufferedReader(_ZstdFrames(raw), 1 << 16)
    newlines = 0
    with raw, stream:
        try:
            while data := stream.read1(1 << 16):
                newlines += data.count(b"\n")
        except errors:
            pass
    return newlines


def iter_ranges(path: Path, chunk_bytes: int = CHUNK_BYTES, start: int = 0) -> Iterator[tuple[int, int]]:
    """Yield `(start, end)` byte ranges of an uncompressed file that cover it from `start` in blocks
    of whole lines: each range ends just after a newline (or at the end of the file), and is about
    `chunk_bytes` long, longer only when a line is. Reads only the bytes around each cut."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while start < size:
            end = start + chunk_bytes
            if end >= size:
                end = size
            else:
                f.seek(end)
                while True:
                    piece = f.read(1 << 16)
                    if not piece:
                        end = size
                        break
                    newline = piece.find(b"\n")
                    if newline >= 0:
                        end += newline + 1
                        break
                    end += len(piece)
            yield start, end
            start = end


def read_range(path: Path | str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise OSError(f"{path}: expected {end - start} bytes at offset {start}, read {len(data)} (the file shrank while being read)")
    return data


def line_offset(path: Path, line: int) -> int:
    """Byte offset where 1-based `line` of an uncompressed file starts (the file's size if it has
    fewer lines); counts newlines in large blocks, so resuming deep into a big file is quick."""
    pos, current = 0, 1
    with open(path, "rb") as f:
        while current < line:
            block = f.read(1 << 24)
            if not block:
                break
            n = block.count(b"\n")
            if current + n < line:
                current += n
                pos += len(block)
                continue
            return pos + _offset_of_line(block, line - current)
    return pos


def _offset_of_line(data: bytes, n: int) -> int:
    """Byte offset of the start of line n (0-based) within data."""
    pos = 0
    for _ in range(n):
        pos = data.index(b"\n", pos) + 1
    return pos


def parse_chunk(data: bytes, first_line: int, text_file: bool, text_field: str = "text") -> list[tuple[int, str | None, str | None]]:
    """Parse one block into `(line, text, None)` for each document and `(line, None, reason)` for each skip."""
    return _parse(data, first_line, text_file, text_field)[0]


def _parse(data: bytes, first_line: int, text_file: bool, text_field: str) -> tuple[list[tuple[int, str | None, str | None]], int]:
    """`parse_chunk`'s records and the number of newlines in `data` (known from the split, so the
    block is not scanned once more to count them)."""
    if text_file:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return [(first_line, None, INVALID_UTF8)], data.count(b"\n")
        return [(first_line, text, None) if text.strip() else (first_line, None, EMPTY)], data.count(b"\n")
    out = []
    lines = data.split(b"\n")
    for lineno, record, reason in _json_records(lines, first_line):
        if reason is not None:
            out.append((lineno, None, reason))
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
    return out, len(lines) - 1


def _json_records(lines: list[bytes], first_line: int):
    """`(line number, record, None)` per JSON line, `(line number, None, reason)` per line that does not parse;
    blank lines (and the empty tail after the last newline) are not records."""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield first_line + i, orjson.loads(line), None
        except orjson.JSONDecodeError as e:
            # Invalid UTF-8 bytes and escaped lone surrogates both make text that cannot be
            # UTF-8 encoded; they are an encoding problem, not a JSON syntax one.
            yield first_line + i, None, INVALID_UTF8 if "surrogate" in str(e) or not _is_utf8(line) else MALFORMED_JSON


def _parse_chat(data: bytes) -> tuple[list[tuple[int, object, str | None]], int]:
    """A block of conversation records: `(line, messages, None)` per record holding a `messages`
    field (whatever it holds: the chat encoder judges it), `(line, None, reason)` per skip."""
    out = []
    lines = data.split(b"\n")
    for lineno, record, reason in _json_records(lines, 0):
        if reason is not None:
            out.append((lineno, None, reason))
            continue
        if not isinstance(record, dict) or CHAT_FIELD not in record:
            out.append((lineno, None, MISSING_MESSAGES))
            continue
        out.append((lineno, record[CHAT_FIELD], None))
    return out, len(lines) - 1


def load_chat_block(block: "Block") -> tuple[list[tuple[int, object, str | None]], int, int]:
    """`load_block` for conversations (`--format chat`): records `(line, messages, reason)`, lines
    counted from 0 within the block, the number of lines (rows) and the bytes read."""
    if isinstance(block, RowGroup):
        pq = _pyarrow_parquet(Path(block.path))
        column = pq.ParquetFile(block.path).read_row_group(block.index, columns=[CHAT_FIELD]).column(0).slice(block.skip)
        rows = column.to_pylist()
        records = [(i, None, MISSING_MESSAGES) if m is None else (i, m, None) for i, m in enumerate(rows)]
        return records, len(rows), column.nbytes
    data = block.data if isinstance(block, InMemory) else read_range(block.path, block.start, block.end)
    records, newlines = _parse_chat(data)
    return records, newlines, len(data)


def _parse_preference(data: bytes) -> tuple[list[tuple[int, object, str | None]], int]:
    """A block of preference records: `(line, (chosen, rejected), None)` per object holding both fields
    (whatever they hold: `prepare.preferences` judges them), `(line, None, reason)` per skip."""
    out = []
    lines = data.split(b"\n")
    for lineno, record, reason in _json_records(lines, 0):
        if reason is None and not isinstance(record, dict):
            reason = NOT_AN_OBJECT
        if reason is None:
            reason = next((MISSING_SIDE[k] for k in PREFERENCE_FIELDS if k not in record), None)
        out.append((lineno, None, reason) if reason is not None else (lineno, tuple(record[k] for k in PREFERENCE_FIELDS), None))
    return out, len(lines) - 1


def load_preference_block(block: "Block") -> tuple[list[tuple[int, object, str | None]], int, int]:
    """`load_chat_block` for preference pairs (`--format preference`): records `(line, (chosen, rejected), reason)`."""
    if isinstance(block, RowGroup):
        pq = _pyarrow_parquet(Path(block.path))
        table = pq.ParquetFile(block.path).read_row_group(block.index, columns=list(PREFERENCE_FIELDS)).slice(block.skip)
        sides = [table.column(k).to_pylist() for k in PREFERENCE_FIELDS]
        records = []
        for i, pair in enumerate(zip(*sides)):
            missing = next((MISSING_SIDE[k] for k, v in zip(PREFERENCE_FIELDS, pair) if v is None), None)
            records.append((i, None, missing) if missing else (i, pair, None))
        return records, table.num_rows, table.nbytes
    data = block.data if isinstance(block, InMemory) else read_range(block.path, block.start, block.end)
    records, newlines = _parse_preference(data)
    return records, newlines, len(data)


@dataclass(frozen=True)
class InMemory:
    """A block already read (decompressed lines, by the coordinating process)."""

    data: bytes
    text_file: bool


@dataclass(frozen=True)
class ByteRange:
    """Bytes `start:end` of an uncompressed file: whole lines, or a whole `.txt` file."""

    path: str
    start: int
    end: int
    text_file: bool


@dataclass(frozen=True)
class RowGroup:
    """Row group `index` of a Parquet file, less its first `skip` rows (a resume point)."""

    path: str
    index: int
    skip: int = 0


Block = InMemory | ByteRange | RowGroup


def iter_blocks(path: Path, chunk_bytes: int = CHUNK_BYTES, start_line: int = 1) -> Iterator[tuple[int | None, Block, int]]:
    """Yield `(first_line, block, disk_bytes_done)` covering the file from 1-based `start_line`.

    `first_line` is the line the block starts at, or None where only reading the block can tell
    (a byte range after the first: the caller counts the lines of the blocks before, see `load_block`).
    """
    path = Path(path)
    if is_compressed(path):
        for first_line, data, consumed in iter_chunks(path, chunk_bytes, start_line):
            yield first_line, InMemory(data, is_text_file(path)), consumed
    elif is_text_file(path):
        if start_line <= 1:
            size = path.stat().st_size
            yield 1, ByteRange(str(path), 0, size, True), size
    elif is_parquet(path):
        meta = _pyarrow_parquet(path).ParquetFile(path).metadata
        size, total = path.stat().st_size, max(meta.num_rows, 1)
        first = 1
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if first + rows > start_line and rows:
                skip = max(start_line - first, 0)
                yield first + skip, RowGroup(str(path), g, skip), size * (first - 1 + rows) // total
            first += rows
    else:
        offset = line_offset(path, start_line) if start_line > 1 else 0
        for i, (begin, end) in enumerate(iter_ranges(path, chunk_bytes, offset)):
            yield (start_line if i == 0 else None), ByteRange(str(path), begin, end, False), end


def load_block(block: Block, text_field: str, head: int | None = None) -> tuple[list[tuple[int, str | None, str | None]], int, int]:
    """Read and parse a block: `(records, lines, text_bytes)`, records as in `parse_chunk` with lines
    counted from 0 within the block, `lines` the number of lines (rows) the block spans. `head`: read
    only about that many first rows of a row group (a sample, without loading the whole group)."""
    if isinstance(block, RowGroup):
        pq = _pyarrow_parquet(Path(block.path))
        import pyarrow.compute as pc

        f = pq.ParquetFile(block.path)
        if head is None:
            column = f.read_row_group(block.index, columns=[text_field]).column(0).slice(block.skip)
        else:
            column = next(f.iter_batches(batch_size=block.skip + head, row_groups=[block.index], columns=[text_field])).column(0).slice(block.skip)
        texts = column.to_pylist()
        records = [(i, None, MISSING_FIELD) if t is None else (i, None, EMPTY) if not t.strip() else (i, t, None) for i, t in enumerate(texts)]
        return records, len(texts), pc.sum(pc.binary_length(column)).as_py() or 0
    data = block.data if isinstance(block, InMemory) else read_range(block.path, block.start, block.end)
    records, newlines = _parse(data, 0, block.text_file, text_field)
    return records, newlines, len(data)


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, in order, silently passing over records that are not documents."""
    for _, block, _ in iter_blocks(Path(path)):
        for _, text, _ in load_block(block, text_field)[0]:
            if text is not None:
                yield text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
