"""What a worker process of data preparation does: parse and tokenize a block of lines, tokenize whole
files into pieces (whole-file mode), or check the fast backend on a slice of texts.

Everything here runs the same in any process (a worker, or the coordinating process when it
tokenizes too), so that every block is encoded the same way whatever the worker count: a worker
knows only its `Spec` and its task. The coordinating side (`pipeline`) hands out the work and puts
the results in order.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from olmo_ds.data import shards
from olmo_ds.data.prepare import readers
from olmo_ds.data.prepare.conversations import encode_records
from olmo_ds.data.prepare.long_docs import encode_documents
from olmo_ds.data.prepare.output import position, split_position
from olmo_ds.data.prepare.pieces import PieceResult, ShardJob, Task, mask_piece, write_part
from olmo_ds.data.prepare.preferences import encode_pairs
from olmo_ds.data.prepare.prompts import encode_prompts, load_prompt_block
from olmo_ds.tokenizer import first_difference, load_tokenizer

# Per worker process: the loaded tokenizer for a `Spec`, so each worker loads it once.
loaded_tokenizers: dict = {}


@dataclass(frozen=True)
class Spec:
    """What a worker needs to tokenize a block the same way as every other worker."""

    tokenizer: str
    eos_token: str | None
    backend: str  # "hf" | "fast": which encoder `load_tokenizer` builds
    text_field: str
    val_fraction: float
    split_special_tokens: bool
    special_texts: tuple[str, ...]  # the special tokens' text, to count the documents holding any
    # Conversations (`--format chat`, `prepare.conversations`) and preference pairs (`--format preference`,
    # `prepare.preferences`); the defaults are the text path's.
    format: str = "text"  # "text" | "chat" | "preference" | "rl"
    chat_template: str | None = None  # what `load_chat_template` loads: a built-in name or a path
    chat_mask: str = "assistant"
    max_tokens: int | None = None
    long_conversations: str = "drop"
    # RL prompts (`--format rl`, `prepare.prompts`): verifier, ground truth -> the verifier's name, or a ValueError
    check_ground_truth: object = None



def tokenizer_for(spec: Spec):
    if spec not in loaded_tokenizers:
        tok = load_tokenizer(spec.tokenizer, spec.eos_token, backend=spec.backend)
        tok.split_special_tokens = spec.split_special_tokens
        loaded_tokenizers[spec] = tok
    return loaded_tokenizers[spec]


def special_token_texts(tok) -> tuple[str, ...]:
    """The text of an HF tokenizer's special added tokens (`<|endoftext|>`, `<|pad|>`, ...). A
    sentencepiece model has none that text can produce: its control symbols never match input."""
    if tok.kind != "hf":
        return ()
    added = orjson.loads(Path(tok.path).read_bytes()).get("added_tokens") or []  # orjson: a 7 MB tokenizer.json in 20 ms, not 80
    return tuple(sorted({t["content"] for t in added if t.get("special") and t.get("content")}))


def holds_special_text(texts: list[str], specials: tuple[str, ...]) -> np.ndarray:
    """Per text, whether any special token's text occurs in it. One substring scan per distinct
    two-character prefix (all of dolma2's eight start with "<|"), the rest only on a hit."""
    by_prefix: dict[str, list[str]] = {}
    for sp in specials:
        by_prefix.setdefault(sp[:2], []).append(sp)
    return np.array([any(p in t and any(sp in t for sp in group) for p, group in by_prefix.items()) for t in texts], dtype=bool)


@dataclass
class ChunkResult:
    file_index: int
    tokens: np.ndarray  # the documents' ids, each followed by EOS, in the shard dtype
    doc_lens: np.ndarray  # int64 tokens per document, EOS included
    positions: np.ndarray  # int64 input position of each document (line within the block until `at_line`)
    is_val: np.ndarray | None  # bool per document, when there is a validation split
    skips: list[tuple[int, str]]  # (position, reason), like `positions`
    special_at: np.ndarray  # int64 positions of the documents whose text holds a special token's text, like `positions`
    text_bytes: int
    n_lines: int  # newlines in the block: the next block starts this many lines later
    mask: np.ndarray | None = None  # conversations: the loss mask, one bool per token of `tokens`
    notes: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (position, reason) of documents kept but noted, like `positions`
    records: list[bytes] | None = None  # RL prompts: each document's sidecar record, without its source (`prompts.with_source`)

    def at_line(self, first_line: int) -> None:
        """Turn block-relative line numbers into the file's, the block starting at `first_line`."""
        self.positions += first_line
        self.special_at += first_line
        self.skips = [(p + first_line, *rest) for p, *rest in self.skips]
        self.notes = [(p + first_line, reason) for p, reason in self.notes]


ALL_LINES = 1 << 40  # `train_done`: every line of the block


def train_lines_done(file_index: int, first_line: int, train_from: int) -> int:
    """How many leading lines of a block of file `file_index` starting at file line `first_line`
    hold train documents already in complete shards, the train split resuming at input position
    `train_from` (see `process_chunk`)."""
    train_file, train_line = split_position(train_from)
    if file_index != train_file:
        return ALL_LINES if file_index < train_file else 0
    return max(train_line - first_line, 0)


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


def process_chunk(spec: Spec, file_index: int, block: readers.Block, train_done: int = 0) -> ChunkResult:
    """Read (unless the coordinating process already did), parse and tokenize one block. Lines are
    numbered from 0 within the block (see `ChunkResult.at_line`).

    `train_done`: the block's first lines whose train documents are already in complete shards (a
    resume with a validation split re-reads from the split's resume point, which lags the train
    split's; `train_lines_done`). Those documents are not tokenized and not in the result; their
    skips and special-token notes are, since the counts a shard records start from the re-read."""
    tok = tokenizer_for(spec)
    if spec.format in ("chat", "preference"):
        return _chat_chunk(spec, tok, file_index, block, train_done)
    if spec.format == "rl":
        return _prompt_chunk(spec, tok, file_index, block, train_done)
    records, n_lines, text_bytes = readers.load_block(block, spec.text_field)
    base = position(file_index, 0)
    texts = [text for _, text, _ in records if text is not None]
    lines = np.array([line for line, text, _ in records if text is not None], dtype=np.int64)
    skips = [(base + line, reason) for line, text, reason in records if text is None]
    special_at = base + lines[holds_special_text(texts, spec.special_texts)]
    is_val, keep = _split_and_keep(spec, texts, lines, train_done)
    if keep is not None:
        texts, lines = [t for t, k in zip(texts, keep) if k], lines[keep]
        is_val = None if is_val is None else is_val[keep]
    ids, offsets = encode_documents(tok, texts) if texts else (np.zeros(0, np.uint32), np.zeros(1, np.int64))
    tokens, doc_lens = append_eos(ids, offsets, tok.eos_id, shards.dtype_for_vocab(tok.vocab_size))
    return ChunkResult(file_index, tokens, doc_lens, base + lines, is_val, skips, special_at, text_bytes, n_lines)


def _split_and_keep(spec: Spec, texts: list[str], lines: np.ndarray, train_done: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Which documents go to the validation split (None without one), and which to keep on a resume (None: all):
    those after `train_done`, where the train split resumes, and every validation document (its split lags)."""
    is_val = None
    if spec.val_fraction > 0:
        threshold = int(spec.val_fraction * 2**64)
        is_val = np.array([val_hash(t) < threshold for t in texts], dtype=bool)
    if train_done <= 0:
        return is_val, None
    return is_val, (lines >= train_done if is_val is None else (lines >= train_done) | is_val)


def _chat_chunk(spec: Spec, tok, file_index: int, block: readers.Block, train_done: int) -> ChunkResult:
    """`process_chunk` for conversations (and preference pairs): every record is encoded (its skip or note
    counts even where its documents are already in a complete shard), then the records before `train_done`
    are left out. A pair is one record of two documents (chosen, rejected): both carry its input position
    and its split, so nothing downstream can separate them."""
    pairs = spec.format == "preference"
    load, encode = (readers.load_preference_block, encode_pairs) if pairs else (readers.load_chat_block, encode_records)
    records, n_lines, text_bytes = load(block)
    base = position(file_index, 0)
    dtype = shards.dtype_for_vocab(tok.vocab_size)
    lines, tokens, doc_lens, mask, skips, special, notes, texts = encode(spec, tok, records, base, dtype)
    is_val, keep = _split_and_keep(spec, texts, lines, train_done)  # per record
    per_record = 2 if pairs else 1
    if keep is not None:
        doc_keep = np.repeat(keep, per_record)
        token_keep = np.repeat(doc_keep, doc_lens)
        tokens, mask, doc_lens, lines = tokens[token_keep], mask[token_keep], doc_lens[doc_keep], lines[keep]
        is_val = None if is_val is None else is_val[keep]
    positions, is_val = np.repeat(base + lines, per_record), None if is_val is None else np.repeat(is_val, per_record)
    return ChunkResult(file_index, tokens, doc_lens, positions, is_val, skips, base + special, text_bytes, n_lines, mask, notes)


def _prompt_chunk(spec: Spec, tok, file_index: int, block: readers.Block, train_done: int) -> ChunkResult:
    """`process_chunk` for RL prompts: `_chat_chunk`'s rule (every record checked, those before `train_done` then
    left out), one document and one sidecar record per kept record, no loss mask."""
    records, n_lines, text_bytes = load_prompt_block(block)
    base = position(file_index, 0)
    lines, tokens, doc_lens, skips, special, texts, out = encode_prompts(spec, tok, records, base, shards.dtype_for_vocab(tok.vocab_size))
    is_val, keep = _split_and_keep(spec, texts, lines, train_done)
    if keep is not None:
        tokens, doc_lens, lines = tokens[np.repeat(keep, doc_lens)], doc_lens[keep], lines[keep]
        out = [r for r, k in zip(out, keep) if k]
        is_val = None if is_val is None else is_val[keep]
    return ChunkResult(file_index, tokens, doc_lens, base + lines, is_val, skips, base + special, text_bytes, n_lines, records=out)


def _tokenize_task(spec: Spec, task: Task) -> PieceResult:
    """Whole-file mode, in a worker: read (decompressing), parse and tokenize the task's files block
    by block, appending each split's ids to its piece file; return everything but the ids."""
    results, per_file = [], []
    outs: dict[str, object] = {}
    try:
        for k, (fi, path) in enumerate(task.files):
            next_line = task.start_line if k == 0 else 1
            docs = tokens = skipped = 0
            for first_line, block, _ in readers.iter_blocks(Path(path), task.chunk_bytes, next_line):
                if first_line is not None:
                    next_line = first_line
                res = process_chunk(spec, fi, block, train_lines_done(fi, next_line, task.train_from))
                res.at_line(next_line)
                next_line += res.n_lines
                if task.pieces is not None:
                    _append_to_pieces(task, outs, res)
                docs, tokens, skipped = docs + len(res.doc_lens), tokens + len(res.tokens), skipped + len(res.skips)
                res.tokens = res.mask = None
                results.append(res)
            per_file.append((fi, docs, tokens, skipped))
    finally:
        for split, f in outs.items():
            with shards.naming(Path(split if split not in ("train", "val") else task.piece(split))):
                f.close()
    return PieceResult(
        doc_lens=_concat([r.doc_lens for r in results], np.int64),
        positions=_concat([r.positions for r in results], np.int64),
        is_val=_concat([r.is_val for r in results], bool) if spec.val_fraction > 0 else None,
        special_at=_concat([r.special_at for r in results], np.int64),
        skips=[skip for r in results for skip in r.skips],
        text_bytes=sum(r.text_bytes for r in results),
        files=per_file,
        notes=[note for r in results for note in r.notes],
    )


def _append_to_pieces(task: Task, outs: dict, res: ChunkResult) -> None:
    """Append a block's ids to the task's piece files, each split's to its own (opened on first use)."""
    if res.is_val is None:
        parts = {"train": (res.tokens, res.mask)}
    else:
        token_is_val = np.repeat(res.is_val, res.doc_lens)
        parts = {"train": (res.tokens[~token_is_val], None if res.mask is None else res.mask[~token_is_val]),
                 "val": (res.tokens[token_is_val], None if res.mask is None else res.mask[token_is_val])}
    for split, (ids, mask) in parts.items():
        if len(ids):
            with shards.naming(Path(task.piece(split))):
                if split not in outs:
                    outs[split] = open(task.piece(split), "wb")
                outs[split].write(memoryview(ids).cast("B"))
            if mask is not None:
                path = mask_piece(task.piece(split))
                with shards.naming(Path(path)):
                    if path not in outs:
                        outs[path] = open(path, "wb")
                    outs[path].write(shards.mask_bytes(mask))


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


@dataclass(frozen=True)
class CheckSlice:
    """Some of the texts on which fastokens must give HF's ids (`backend`), checked in a worker."""

    texts: tuple[str, ...]
    labels: tuple[str, ...]


def check_slice(spec: Spec, part: CheckSlice) -> str | None:
    """The first of the slice's texts that `spec`'s fast encoder encodes otherwise than HF, or None."""
    reference = tokenizer_for(dataclasses.replace(spec, backend="hf"))
    return first_difference(tokenizer_for(spec), reference, list(part.texts), list(part.labels))


def files_worker(spec: Spec, task: Task | ShardJob):
    """`TaskPool`'s function in whole-file mode: tokenize a task into pieces, or write a part of a shard
    from them. (The fast backend's check runs in the coordinating process there: `backend.BesideCheck`.)"""
    return _tokenize_task(spec, task) if isinstance(task, Task) else write_part(task)



def chunk_in_worker(spec: Spec, *args) -> tuple[ChunkResult | str | None, np.ndarray]:
    """`process_chunk` for `OrderedPool`: the tokens travel as raw bytes, the rest as the header.
    (Or the fast backend's check on a slice of texts: its finding is the header.)"""
    if isinstance(args[0], CheckSlice):
        return check_slice(spec, args[0]), np.zeros(0, np.uint8)
    res = process_chunk(spec, *args)
    tokens, res.tokens = res.tokens, None
    return res, tokens
