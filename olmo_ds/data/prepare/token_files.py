"""OLMo's released token files as training sources in place: a manifest over the existing files.

OLMo and Dolma ship pre-tokenized mixes as `.npy` files that are raw little-endian memmaps (uint32
for the dolma2 tokenizer, uint16 for GPT-NeoX's; no `.npy` header despite the name), documents
concatenated, each ending in EOS; Dolma may put a `.csv.gz` beside each (`start,end[,...]` token
offsets per document, the name OLMo-core derives by replacing `.npy`). `register_token_files` scans
every file once, in parallel, and writes a source directory that the loader reads like any shard
directory, so it mixes with prepared sources: per file an entry `shard-NNNNN.json` (`ShardMeta`,
its `bin` the token file's absolute path) and `shard-NNNNN.offsets.npy` (the document boundaries,
from the `.csv.gz` where there is one, else after each EOS), then `manifest.json`. No token is
copied. The fingerprint follows the shard rule (`partition.py`): entry names, token counts, sha256s
and the tokenizer, so moving the files elsewhere keeps it, and changing a byte changes it.

The scan refuses, naming the file (and the offset where there is one): a size that is not a
multiple of the dtype, a dtype that the ids show to be wrong, an id outside the tokenizer's
vocabulary, a last token that is not EOS, and an index that does not tile the file.

A document that holds EOS before its end (an index entry spanning an EOS: Dolma's tokenizer turned
a quoted `<|endoftext|>` into the EOS id) is not refused: the files are released as they are. Each
entry records how many (`docs_with_inner_eos`, the first few indexes), the manifest the totals,
`inner_eos_report` says what readers see, and `validate_shards.py` passes such a source with the
same counts (`data/validate.py`).

Fine-tuning data from open-instruct's OLMo-core converter (`convert_sft_data_for_olmocore.py`):
`token_ids_part_XXXX.npy` with `labels_mask_part_XXXX.npy` beside each (headerless `np.bool_`, one
byte per token, 1 = a training target) and the `.csv.gz` of `start,end` per conversation. When the
inputs hold any `labels_mask_*.npy`, every token file must have its mask (`mask_file`) and every mask
its token file, else the registration is refused naming the file; each mask must be exactly one
byte (0 or 1) per token of its token file. The entries then point at the masks in place too
(`ShardMeta.mask`, an absolute path, with `mask_checksum` and `trained_tokens`), and the manifest
says `masked: true` with the trained-token total, so the loader reads it as masked shards.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np

import olmo_ds
from olmo_ds.atomic import atomic_write_bytes, atomic_write_json
from olmo_ds.data import shards
from olmo_ds.data.validate import describe_inner_eos

BLOCK_TOKENS = 1 << 24
INNER_EOS_SHOWN = 5  # documents with an inner EOS named per file
NPY_MAGIC = b"\x93NUMPY"
MASK_PREFIX = "labels_mask"  # open-instruct's loss masks: labels_mask_part_XXXX.npy beside token_ids_part_XXXX.npy
TOKEN_PREFIX = "token_ids"


class TokenFileError(ValueError):
    """A token file (or its index) that cannot be a source as it is; the message names it."""


def resolve_token_files(specs: list[str]) -> list[Path]:
    """Files, directories (searched recursively) and globs of `.npy` token files → sorted list.
    Our own shards' `*.offsets.npy` are not token files and are never picked up."""
    files: set[Path] = set()
    for spec in specs:
        path = Path(spec)
        found = sorted(path.rglob("*.npy")) if path.is_dir() else [path] if path.is_file() else [Path(p) for p in glob.glob(spec, recursive=True)]
        found = [f for f in found if f.is_file() and not f.name.endswith(".offsets.npy")]
        if not found:
            raise FileNotFoundError(f"{spec}: names no .npy token files")
        files.update(f.resolve() for f in found)
    return sorted(files, key=str)


def is_mask_file(path: Path) -> bool:
    return path.name.startswith(MASK_PREFIX)


def mask_file(path: Path) -> Path:
    """Where open-instruct's converter puts a token file's loss mask: `token_ids_part_0003.npy` →
    `labels_mask_part_0003.npy` beside it (the name OLMo-core's SFT scripts glob for)."""
    if not path.name.startswith(TOKEN_PREFIX):
        raise TokenFileError(f"{path}: beside loss masks ({MASK_PREFIX}_*.npy), a token file must be named {TOKEN_PREFIX}_*.npy to say which mask is its own")
    return path.with_name(MASK_PREFIX + path.name[len(TOKEN_PREFIX):])


def pair_masks(files: list[Path]) -> tuple[list[Path], list[Path] | None]:
    """Split the resolved `.npy` files into token files and their masks (None: no masks at all).
    A token file without its mask, or a mask without its token file, is an error naming it."""
    masks = [f for f in files if is_mask_file(f)]
    tokens = [f for f in files if not is_mask_file(f)]
    # Masks lying beside token files count even when only the token files were named (a glob of
    # token_ids_part_*.npy): registering fine-tuning data without its masks would train every token.
    beside = [mask_file(t) for t in tokens if t.name.startswith(TOKEN_PREFIX) and mask_file(t).is_file()]
    masks = sorted(set(masks) | set(beside), key=str)
    if not masks:
        return tokens, None
    if not tokens:
        raise TokenFileError(f"{masks[0]}: loss masks but no token files given ({TOKEN_PREFIX}_*.npy)")
    paired = [mask_file(t) for t in tokens]
    for t, m in zip(tokens, paired):
        if not m.is_file():
            raise TokenFileError(f"{m}: missing: the loss mask of {t} (the other token files have theirs; a fine-tuning source needs one per token file)")
    extra = sorted(set(masks) - set(paired))
    if extra:
        raise TokenFileError(f"{extra[0]}: a loss mask whose token file {extra[0].with_name(TOKEN_PREFIX + extra[0].name[len(MASK_PREFIX):])} is not among the inputs")
    return tokens, paired


def scan_mask(path: Path, num_tokens: int, token_file: Path) -> dict:
    """A loss mask's checks: one byte per token of `token_file`, each 0 or 1; its sha256 and trained count."""
    size = path.stat().st_size
    if size != num_tokens:
        raise TokenFileError(f"{path}: {size:,} bytes, but {token_file} holds {num_tokens:,} tokens (a loss mask is one byte per token)")
    digest, trained, base = hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK_TOKENS):
            values = np.frombuffer(block, dtype=np.uint8)
            bad = np.flatnonzero(values > 1)
            if len(bad):
                raise TokenFileError(f"{path}: byte {base + int(bad[0]):,} is {int(values[bad[0]])}, not 0 or 1 (not a boolean loss mask)")
            digest.update(block)
            trained += int(np.count_nonzero(values))
            base += len(values)
    return {"mask_checksum": "sha256:" + digest.hexdigest(), "trained_tokens": trained}


def index_path(path: Path) -> Path:
    """Where Dolma writes a token file's document index, and OLMo-core looks for it."""
    return path.with_name(path.name.replace(".npy", ".csv.gz"))


def scan(path: Path, dtype: str, vocab_size: int, eos_id: int) -> dict:
    """One file's checks (see the module docstring); returns its metadata fields and offsets."""
    dt = np.dtype(dtype).newbyteorder("<")
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(len(NPY_MAGIC)) == NPY_MAGIC:
            raise TokenFileError(f"{path}: has a NumPy header, so it is not one of OLMo's raw token files (those are headerless memmaps)")
    if size == 0 or size % dt.itemsize:
        raise TokenFileError(f"{path}: size {size:,} bytes is not a positive multiple of {dt.name}'s {dt.itemsize} bytes (wrong --dtype, or a truncated file)")
    digest = hashlib.sha256()
    ends, max_id, odd_nonzero, base = [], -1, False, 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK_TOKENS * dt.itemsize):
            ids = np.frombuffer(block, dtype=dt)
            digest.update(block)
            bad = np.flatnonzero(ids >= vocab_size)
            if len(bad):
                k = base + int(bad[0])
                raise TokenFileError(f"{path}: token {int(ids[bad[0]])} at offset {k:,} (byte {k * dt.itemsize:,}) is not below the tokenizer's vocabulary size {vocab_size:,} (another tokenizer, or not {dt.name} ids)")
            max_id = max(max_id, int(ids.max()))
            odd_nonzero = odd_nonzero or bool(np.any(ids[1::2]))  # blocks hold an even number of ids: odd stays odd
            ends.append(np.flatnonzero(ids == eos_id) + base + 1)
            base += len(ids)
    if dt.itemsize == 2 and base >= 64 and not odd_nonzero:
        raise TokenFileError(f"{path}: every second uint16 id is 0, the pattern of uint32 ids read as uint16; pass --dtype uint32")
    if not len(ends[-1]) or ends[-1][-1] != base:
        with open(path, "rb") as f:
            f.seek(size - dt.itemsize)
            last = int(np.frombuffer(f.read(dt.itemsize), dtype=dt)[0])
        raise TokenFileError(f"{path}: the last token is {last}, not EOS {eos_id}: the file is truncated or was made with another tokenizer")
    eos_ends = np.concatenate(ends)
    index = index_path(path)
    offsets = np.concatenate([[0], eos_ends]).astype(np.int64)
    inner = {"docs": 0, "eos": 0, "first_docs": []}
    if index.is_file():
        offsets = _read_index(index, base)
        # A document the index keeps whole though it holds EOS (Dolma's tokenizer turned a quoted
        # "<|endoftext|>" into the EOS id): kept as released, and reported.
        at = np.setdiff1d(eos_ends, offsets[1:]) - 1
        docs = np.unique(np.searchsorted(offsets, at, side="right") - 1)
        inner = {"docs": len(docs), "eos": len(at), "first_docs": docs[:INNER_EOS_SHOWN].tolist()}
    return {"num_tokens": base, "max_token_id": max_id, "checksum": "sha256:" + digest.hexdigest(), "offsets": offsets,
            "index": index.name if index.is_file() else None, "inner_eos": inner}


def _read_index(index: Path, num_tokens: int) -> np.ndarray:
    """A Dolma `.csv.gz` index (`start,end[,...]` per document) as offsets; it must tile the file."""
    offsets = [0]
    with gzip.open(index, "rt") as f:
        for line_no, line in enumerate(f, 1):
            try:
                start, end = (int(x) for x in line.split(",")[:2])
            except ValueError:
                raise TokenFileError(f"{index}:{line_no}: expected start,end token offsets, got {line.strip()[:80]!r}") from None
            if start != offsets[-1] or end <= start:
                raise TokenFileError(f"{index}:{line_no}: document {start}..{end} does not follow the previous one (ending at {offsets[-1]}); the index must cover the file in order")
            offsets.append(end)
    if offsets[-1] != num_tokens:
        raise TokenFileError(f"{index}: documents end at token {offsets[-1]:,}, the file holds {num_tokens:,}")
    return np.asarray(offsets, dtype=np.int64)


def _scan_one(args) -> dict | str:
    *args, mask = args
    try:
        result = scan(*args)
        if mask is not None:
            result["mask"] = {"path": mask, **scan_mask(mask, result["num_tokens"], args[0])}
        return result
    except (TokenFileError, OSError) as e:
        return str(e)


def register_token_files(inputs: list[str], output: Path, tokenizer, dtype: str | None = None, workers: int = 1) -> shards.Manifest:
    """Scan the token files (in parallel) and write the source directory OUTPUT over them."""
    files, masks = pair_masks(resolve_token_files(inputs))
    dtype = dtype or shards.dtype_for_vocab(tokenizer.vocab_size).name
    if dtype not in ("uint16", "uint32"):
        raise TokenFileError(f"--dtype {dtype}: OLMo's token files are uint16 or uint32")
    if dtype == "uint16" and tokenizer.vocab_size > 65536:
        raise TokenFileError(f"--dtype uint16 cannot hold {tokenizer.path}'s {tokenizer.vocab_size:,} ids; its token files are uint32")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise TokenFileError(f"--output {out}: not empty; register into a new directory (the token files themselves are never written)")
    tasks = [(f, dtype, tokenizer.vocab_size, tokenizer.eos_id, masks[i] if masks else None) for i, f in enumerate(files)]
    if workers > 1 and len(tasks) > 1:
        with mp.get_context("fork").Pool(min(workers, len(tasks))) as pool:
            results = pool.map(_scan_one, tasks)
    else:
        results = [_scan_one(t) for t in tasks]
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise TokenFileError(f"{len(errors)} of {len(files)} token files refused:\n  " + "\n  ".join(errors))
    out.mkdir(parents=True, exist_ok=True)
    metas = []
    for i, (f, r) in enumerate(zip(files, results)):
        buf = io.BytesIO()
        np.save(buf, r["offsets"])
        atomic_write_bytes(shards.offsets_path(out, i), buf.getvalue())
        num_docs = len(r["offsets"]) - 1
        meta = shards.ShardMeta(num_tokens=r["num_tokens"], num_docs=num_docs, avg_doc_len=r["num_tokens"] / num_docs, dtype=dtype,
                                vocab_size=tokenizer.vocab_size, max_token_id=r["max_token_id"], eos_id=tokenizer.eos_id,
                                checksum=r["checksum"], bin=str(f), offsets=shards.offsets_path(out, i).name,
                                **({"mask": str(r["mask"]["path"]), "mask_checksum": r["mask"]["mask_checksum"],
                                    "trained_tokens": r["mask"]["trained_tokens"]} if "mask" in r else {}))
        inner = r["inner_eos"]
        atomic_write_json(shards.meta_path(out, i), {"in_place": {"index": r["index"], "docs_with_inner_eos": inner["docs"], "inner_eos": inner["eos"],
                                                                  "inner_eos_docs": inner["first_docs"]}, **meta.to_dict()})
        metas.append(meta)
    root = os.path.commonpath([str(f) for f in files]) if len(files) > 1 else str(files[0].parent)
    extra = {"tool": {"name": "olmo-ds register_token_files", "version": olmo_ds.__version__},
             "source": {"format": "olmocore-sft" if masks else "olmo-npy", "in_place": True, "root": root, "files": len(files), "dtype": dtype, "tokenizer": str(tokenizer.path),
                        "docs_with_inner_eos": sum(r["inner_eos"]["docs"] for r in results), "inner_eos": sum(r["inner_eos"]["eos"] for r in results)}}
    return shards.write_manifest(out, tokenizer, "train", extra, metas=metas, names=[shards.bin_path(out, i).name for i in range(len(metas))])


def inner_eos_report(directory: Path) -> list[str]:
    """Per registered file whose documents hold EOS inside: what readers see (empty when none do)."""
    lines = []
    for i in range(len(shards.Manifest.load(directory).shards)):
        meta = json.loads(shards.meta_path(directory, i).read_text())
        inner = meta["in_place"]
        if inner.get("docs_with_inner_eos"):
            lines.append(f"{meta['bin']}: " + describe_inner_eos(inner["docs_with_inner_eos"], inner["inner_eos"], inner["inner_eos_docs"], meta["num_docs"]))
    return lines
