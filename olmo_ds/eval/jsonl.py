"""JSON-lines input for evaluation: every record must be usable, or the run stops naming file:line.

Evaluation reads small files and a wrong number is worse than no number, so unlike data
preparation (which counts and skips bad records in terabytes of text) nothing here is skipped.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator

import orjson

SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".jsonl.zstd")


def open_binary(path: Path):
    """The decompressed bytes of a plain, gzip or zstd file."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith((".zst", ".zstd")):
        import zstandard

        return zstandard.open(path, "rb")
    return open(path, "rb")


def read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for every non-blank line; raises on anything but a JSON object."""
    path = Path(path)
    with open_binary(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def read_texts(path: Path, text_field: str = "text") -> Iterator[str]:
    """The `text_field` string of every record; blank texts are skipped (they hold no tokens)."""
    for lineno, record in read_records(path):
        if text_field not in record:
            raise ValueError(f"{path}:{lineno}: missing key {text_field!r}")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: {text_field!r} must be a string, got {type(text).__name__}")
        if text.strip():
            yield text
