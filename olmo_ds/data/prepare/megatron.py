"""Convert between our shard directories and the Megatron-LM / GPT-NeoX indexed dataset (`.bin` + `.idx`).

Users bring corpora already tokenized for Megatron or GPT-NeoX and take ours there. The `.idx` is:

    magic b"MMIDIDX\\x00\\x00" | u64 version (1) | u8 dtype code | u64 N sequences | u64 D
    | int32 sizes[N] | int64 byte pointers[N] | int64 doc_idx[D]   (all little-endian)

with doc_idx starting at 0 and ending at N: document i is sequences doc_idx[i]..doc_idx[i+1]-1
(one sequence per document unless the data was sentence-split). Dtype codes: 1 u8, 2 i8, 3 i16,
4 i32, 5 i64, 8 u16. Codes 6 and 7 mean different float types in the two projects and never hold
token ids, so they are refused. Our uint32 ids go out as int32 (code 4, what Megatron picks for
vocabularies above 65,535); ids are non-negative and below 2^31, so the bytes are the same.

Everything streams: neither direction holds a shard, the corpus or the index in memory.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_ds.data import shards

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D
BLOCK = 1 << 22  # elements per streamed block


@dataclass
class IndexedDataset:
    """A memory-mapped view of a Megatron/NeoX `.bin` + `.idx` pair."""

    prefix: Path
    dtype: np.dtype
    sizes: np.ndarray  # int32 [N]
    pointers: np.ndarray  # int64 [N]
    doc_idx: np.ndarray  # int64 [D]
    tokens: np.ndarray  # the whole .bin

    @property
    def num_docs(self) -> int:
        return len(self.doc_idx) - 1


def _paths(prefix: Path) -> tuple[Path, Path]:
    prefix = Path(prefix)
    if prefix.suffix in (".bin", ".idx"):
        prefix = prefix.with_suffix("")
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


def read_indexed(prefix: Path) -> IndexedDataset:
    """Open PREFIX.bin/PREFIX.idx, checking the header and that sequences tile the `.bin` in order."""
    bin_file, idx_file = _paths(prefix)
    for f in (bin_file, idx_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: not found (expected a Megatron/GPT-NeoX indexed dataset PREFIX.bin + PREFIX.idx)")
    with open(idx_file, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[:9] != MAGIC:
        raise ValueError(f"{idx_file}: not a Megatron/GPT-NeoX index (magic {head[:9]!r} != {MAGIC!r})")
    _, version, code, n, d = _HEADER.unpack(head)
    if version != VERSION:
        raise ValueError(f"{idx_file}: index version {version}, only version {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_file}: dtype code {code} does not hold token ids (supported: {sorted(DTYPE_CODES)}; 6 and 7 are float types that Megatron and NeoX define differently)")
    expected = _HEADER.size + 4 * n + 8 * n + 8 * d
    if idx_file.stat().st_size != expected:
        raise ValueError(f"{idx_file}: {idx_file.stat().st_size} bytes, but a header of N={n}, D={d} needs {expected}")
    mm = np.memmap(idx_file, mode="r")
    sizes = np.frombuffer(mm, dtype="<i4", count=n, offset=_HEADER.size)
    pointers = np.frombuffer(mm, dtype="<i8", count=n, offset=_HEADER.size + 4 * n)
    doc_idx = np.frombuffer(mm, dtype="<i8", count=d, offset=_HEADER.size + 12 * n)
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    if d < 1 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise ValueError(f"{idx_file}: doc_idx must start at 0, not decrease and end at N={n}")
    total = int(sizes.sum(dtype=np.int64))
    if bin_file.stat().st_size != total * dtype.itemsize:
        raise ValueError(f"{bin_file}: {bin_file.stat().st_size} bytes, but the index's sizes sum to {total} tokens x {dtype.itemsize}")
    starts = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]) * dtype.itemsize if n else np.zeros(0, np.int64)
    if not np.array_equal(starts, pointers):
        raise ValueError(f"{idx_file}: sequences are not stored back to back in order (pointer {int(np.argmax(starts != pointers))} differs)")
    tokens = np.memmap(bin_file, dtype=dtype, mode="r") if total else np.zeros(0, dtype)
    return IndexedDataset(Path(prefix), dtype, sizes, pointers, doc_idx, tokens)


def export_megatron(directory: Path, prefix: Path) -> tuple[int, int]:
    """Write a shard directory as one PREFIX.bin/PREFIX.idx, one sequence per document.

    Returns (documents, tokens). The `.bin` is the shards' bytes concatenated in order.
    """
    directory = Path(directory)
    manifest = shards.Manifest.load(directory)
    code = 8 if manifest.dtype == "uint16" else 4
    metas = [shards.ShardMeta.load(p.with_suffix(".json")) for p in shards.list_shards(directory)]
    if [m.bin for m in metas] != manifest.shards:
        raise ValueError(f"{directory}: the shards on disk do not match manifest.json; run scripts/validate_shards.py")
    bin_file, idx_file = _paths(prefix)
    bin_file.parent.mkdir(parents=True, exist_ok=True)
    n = sum(m.num_docs for m in metas)
    with open(bin_file.with_name(bin_file.name + ".tmp"), "wb") as out:
        for m in metas:
            with open(directory / m.bin, "rb") as f:
                while block := f.read(BLOCK * 4):
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    with open(idx_file.with_name(idx_file.name + ".tmp"), "wb") as out:
        out.write(_HEADER.pack(MAGIC, VERSION, code, n, n + 1))
        for m in metas:  # sizes
            offsets = shards.load_offsets(directory / m.offsets)
            for s in range(0, m.num_docs, BLOCK):
                out.write(np.diff(offsets[s : s + BLOCK + 1]).astype("<i4").tobytes())
        base = 0
        itemsize = np.dtype(manifest.dtype).itemsize
        for m in metas:  # byte pointers
            offsets = shards.load_offsets(directory / m.offsets)
            for s in range(0, m.num_docs, BLOCK):
                out.write(((base + offsets[s : min(s + BLOCK, m.num_docs)]) * itemsize).astype("<i8").tobytes())
            base += m.num_tokens
        for s in range(0, n + 1, BLOCK):
            out.write(np.arange(s, min(s + BLOCK, n + 1), dtype="<i8").tobytes())
        out.flush()
        os.fsync(out.fileno())
    os.replace(bin_file.with_name(bin_file.name + ".tmp"), bin_file)
    os.replace(idx_file.with_name(idx_file.name + ".tmp"), idx_file)
    return n, manifest.num_tokens


def import_megatron(prefix: Path, directory: Path, tokenizer, shard_tokens: int = 100_000_000, append_eos: bool = False) -> shards.Manifest:
    """Write PREFIX.bin/.idx as a shard directory for `tokenizer` (it sets vocab size, EOS, dtype, fingerprint).

    Each Megatron document (its sequences joined) becomes one of ours and must end in EOS, unless
    `append_eos` (data made without --append-eod). Empty documents are dropped.
    """
    ds = read_indexed(prefix)
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory}: output directory is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    dtype = shards.dtype_for_vocab(tokenizer.vocab_size)
    eos = tokenizer.eos_id
    # Document token boundaries: sequence doc_idx[i] starts document i.
    seq_starts = np.concatenate([[0], np.cumsum(ds.sizes, dtype=np.int64)])
    doc_bounds = seq_starts[ds.doc_idx]
    writer = shards.ShardedWriter(directory, shard_tokens, vocab_size=tokenizer.vocab_size, eos_id=eos)
    num_docs = 0
    for s in range(0, ds.num_docs, BLOCK):
        b = doc_bounds[s : s + BLOCK + 1]
        lens = np.diff(b)
        keep = lens > 0
        tokens = np.asarray(ds.tokens[b[0] : b[-1]])
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
            bad = int(np.argmax((tokens < 0) | (tokens >= tokenizer.vocab_size)))
            raise ValueError(f"{ds.prefix}: token {int(tokens[bad])} at position {int(b[0]) + bad} is outside the tokenizer's vocabulary [0, {tokenizer.vocab_size})")
        tokens = tokens.astype(dtype)
        lens = lens[keep]
        if append_eos:
            tokens = np.insert(tokens, np.cumsum(lens), eos)
            lens = lens + 1
        elif len(lens):
            missing = np.flatnonzero(tokens[np.cumsum(lens) - 1] != eos)
            if len(missing):
                raise ValueError(f"{ds.prefix}: document {s + int(np.flatnonzero(keep)[missing[0]])} does not end in EOS {eos}; pass --append-eos if the data was made without --append-eod")
        writer.add(tokens, lens)
        num_docs += len(lens)
    writer.finish()
    source = {"format": "megatron", "prefix": str(ds.prefix), "documents": ds.num_docs, "dropped_empty": ds.num_docs - num_docs, "append_eos": append_eos}
    return shards.write_manifest(directory, tokenizer, "train", {"source": source})
