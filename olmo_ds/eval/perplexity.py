"""Validation loss, perplexity and bits-per-byte, per source.

Loss per token depends on the tokenizer: a tokenizer with longer tokens has fewer, harder targets.
Bits-per-byte divides the nats by the UTF-8 bytes the target tokens decode to, so runs with
different tokenizers compare on one scale:

    bits_per_byte = sum(nats over target tokens) / (ln 2 * sum(bytes of those tokens))

Special tokens (EOS, padding, ...) decode to no text: they are excluded from both sums (their byte
length is 0 in the table below). `ce_loss` and `perplexity` are over every labelled target,
EOS included, so they match the training loss.

A source is a shard directory (its `val/` split if it has one) or raw JSON lines tokenized here
with the checkpoint's tokenizer, documents each followed by EOS as data preparation writes them.
Either way it becomes rows of `seq_len` consecutive tokens (the last row may be shorter) whose
labels are the inputs shifted left by one, the last position ignored: the loader's layout.

A masked shard directory (fine-tuning conversations, `masked: true` in its manifest) is scored as
training scores it (`olmo_ds.data.loader.validation_batches`): whole conversations packed into rows,
attention and RoPE positions per conversation, only the mask's targets labelled. Its `ce_loss` is
the masked validation loss, the token mean over the trained tokens, as in-loop evaluation reports it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from olmo_ds.data import shards
from olmo_ds.data.dataset import TokenSource
from olmo_ds.data.loader import validation_batches
from olmo_ds.eval.jsonl import SUFFIXES as JSONL_SUFFIXES
from olmo_ds.eval.jsonl import read_texts
from olmo_ds.eval.scoring import DistContext, check_batching, logits_of, model_device, olmo_of, run_split, target_logprobs

IGNORE_INDEX = -100


def token_byte_lengths(tokenizer) -> np.ndarray:
    """int64 [vocab_size]: the UTF-8 bytes each id decodes to; 0 for special tokens.

    Decoding ids one at a time is wrong for byte-level BPE (a token holding half of a multi-byte
    character decodes to U+FFFD, 3 bytes), so the lengths come from the vocabulary itself: a
    byte-level token's string has one character per byte, a sentencepiece byte-fallback piece
    `<0xNN>` is one byte, and `▁` is a space.
    """
    table = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    if tokenizer.kind == "sentencepiece":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer.path))
        for i in range(tokenizer.vocab_size):
            if sp.is_control(i) or sp.is_unknown(i):
                continue
            table[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return table
    spec = json.loads(Path(tokenizer.path).read_text(encoding="utf-8"))
    byte_level = _uses_byte_level(spec.get("decoder"))
    vocab = spec["model"]["vocab"]
    items = vocab.items() if isinstance(vocab, dict) else ((piece, i) for i, (piece, _score) in enumerate(vocab))
    for piece, i in items:
        if byte_level:
            table[i] = len(piece)
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            table[i] = 1
        else:
            table[i] = len(tokenizer.decode([i]).encode("utf-8"))
    for added in spec.get("added_tokens", []):
        table[added["id"]] = 0 if added.get("special") else len(added["content"].encode("utf-8"))
    for special in (tokenizer.eos_id, tokenizer.pad_id):
        if special is not None:
            table[special] = 0
    return table


def _uses_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders", []))


@dataclass
class PerplexityResult:
    ce_loss: float  # mean nats over all labelled targets (the training loss's definition)
    perplexity: float  # exp(ce_loss)
    bits_per_byte: float  # nats / ln 2 / bytes over targets that are text (special tokens excluded)
    tokens: int  # labelled targets
    text_tokens: int  # targets that are not special tokens
    bytes: int  # UTF-8 bytes of the text targets
    seconds: float
    tokens_per_second: float  # labelled targets per second
    rows: int = 0  # rows of tokens scored (the requests of this evaluation), over all ranks
    forward_tokens: int = 0  # positions the model ran, padding rows included, over all ranks
    rows_per_second: float = float("nan")
    forward_tokens_per_second: float = float("nan")
    batching: str = "packed"

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate_perplexity(
    model,
    batches: Sequence[dict],
    token_bytes: np.ndarray,
    *,
    dist_ctx: DistContext | None = None,
    split: bool = True,
    batching: str = "packed",
) -> PerplexityResult:
    """Loss, perplexity and bits-per-byte of `model` on `batches` of `input_ids`/`labels` ([B, T]).

    `split=True`: `batches` is the whole evaluation set, the same on every rank, and is divided
    across ranks here; the result is bitwise that of one rank. `split=False`: each rank passes its
    own share (e.g. `olmo_ds.data.loader.validation_batches(..., dp_rank, dp_world_size)`), every
    rank the same number of batches, and the sums are gathered. Every rank returns the total.

    `batching`: `packed` (default) runs our OLMo's scoring forward (`OLMo.forward(score=...)`: the head
    only on labelled positions, compiled blocks where training compiles them) on batches of one shape,
    every batch topped up to the most rows any has with rows of padding; `exact` (and any other
    model) reads full logits from the batches as given, eagerly. Both give the same numbers up to
    float rounding.
    """
    check_batching(batching)
    dist_ctx = dist_ctx or DistContext.current()
    device = model_device(model)
    byte_table = torch.as_tensor(token_bytes, dtype=torch.long, device=device)
    batches = list(batches)
    scoring = batching == "packed" and olmo_of(model) is not None
    width = max((b["input_ids"].shape[1] for b in batches), default=0)
    rows = max((b["input_ids"].shape[0] for b in batches), default=0)

    def step(b: int) -> tuple[float, int, float, int, int, int, int]:
        batch = batches[b]
        labels = batch["labels"].to(device)
        # Packed conversations (a masked source's validation_batches): attention and RoPE positions per conversation.
        packed = {k: batch[k].to(device) for k in ("doc_lens", "positions") if k in batch} if "positions" in batch and olmo_of(model) is not None else {}
        if scoring:
            if packed and tuple(batch["input_ids"].shape) != (rows, width):
                raise ValueError(f"packed validation batches must all be [{rows}, {width}], got {tuple(batch['input_ids'].shape)}")
            ids, labels = _top_up(batch["input_ids"].to(device), labels, rows, width)
            flat = labels.reshape(-1)
            index = (flat != IGNORE_INDEX).nonzero().squeeze(1)
            targets = flat[index]
            nats = -model(ids, score=(index, targets), **packed).logprob.double()
            mask = torch.ones_like(targets, dtype=torch.bool)
        else:
            ids = batch["input_ids"].to(device)
            logits = logits_of(model, ids, **packed)
            targets = labels.clamp(min=0)
            # Row by row, so no float32 copy of the whole batch's logits is ever made.
            nats = -torch.stack([target_logprobs(logits[r], targets[r]) for r in range(logits.shape[0])]).double()
            mask = labels != IGNORE_INDEX
        nbytes = byte_table[targets] * mask
        text = nbytes > 0
        sums = torch.stack([(nats * mask).sum(), mask.sum().double(), (nats * text).sum(), text.sum().double(), nbytes.sum().double()]).cpu().tolist()
        return sums[0], int(sums[1]), sums[2], int(sums[3]), int(sums[4]), batch["input_ids"].shape[0], ids.numel()

    was_training = getattr(model, "training", False)
    model.eval()
    t0 = time.perf_counter()
    try:
        if split:
            parts = run_split(len(batches), step, dist_ctx)
        else:
            local = DistContext()
            counts = dist_ctx.all_gather(len(batches))
            if len(set(counts)) != 1:
                raise ValueError(f"evaluate_perplexity(split=False) needs the same number of batches on every rank (ZeRO-3 forwards are collective), got {counts}")
            parts = [p for rank_parts in dist_ctx.all_gather(run_split(len(batches), step, local)) for p in rank_parts]
    finally:
        if was_training:
            model.train()
    seconds = time.perf_counter() - t0
    nats, tokens, text_nats, text_tokens, nbytes, num_rows, positions = (sum(p[k] for p in parts) for k in range(7))
    if tokens == 0:
        raise ValueError("evaluate_perplexity: the batches hold no labelled target tokens")
    ce = nats / tokens

    def rate(n: int) -> float:
        return n / seconds if seconds > 0 else float("nan")

    return PerplexityResult(
        ce_loss=ce,
        perplexity=math.exp(ce),
        bits_per_byte=text_nats / (math.log(2) * nbytes) if nbytes else float("nan"),
        tokens=tokens,
        text_tokens=text_tokens,
        bytes=nbytes,
        seconds=seconds,
        tokens_per_second=rate(tokens),
        rows=num_rows,
        forward_tokens=positions,
        rows_per_second=rate(num_rows),
        forward_tokens_per_second=rate(positions),
        batching=batching,
    )


def conversation_batches(directory: Path, seq_len: int, batch_size: int, max_tokens: int | None = None) -> list[dict]:
    """A masked source's packed rows of `seq_len` (as training packs them; `long_conversations` truncate), `batch_size`
    rows a batch, the last topped up with padding rows; with `max_tokens`, the first max_tokens // seq_len rows (at least 1)."""
    batches = list(validation_batches(directory, seq_len, batch_size, 0, 1, document_masking=True))
    if max_tokens is not None:
        rows = max(1, max_tokens // seq_len)
        batches = batches[: math.ceil(rows / batch_size)]
    return batches


def _top_up(ids: torch.Tensor, labels: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids`/`labels` padded to [rows, width]: padding ids 0, labels ignored (the model is causal and
    the rows are independent, so padding changes no score)."""
    b, t = ids.shape
    if (b, t) == (rows, width):
        return ids, labels
    out_ids = ids.new_zeros((rows, width))
    out_labels = labels.new_full((rows, width), IGNORE_INDEX)
    out_ids[:b, :t], out_labels[:b, :t] = ids, labels
    return out_ids, out_labels


def window_batches(tokens: np.ndarray, seq_len: int, batch_size: int) -> list[dict]:
    """Rows of `seq_len` consecutive tokens (the last one shorter, right-padded) with shifted labels."""
    tokens = np.asarray(tokens, dtype=np.int64)
    starts = list(range(0, len(tokens), seq_len))
    batches = []
    for b in range(0, len(starts), batch_size):
        rows = starts[b : b + batch_size]
        input_ids = np.zeros((len(rows), seq_len), dtype=np.int64)
        labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
        for r, s in enumerate(rows):
            piece = tokens[s : s + seq_len]
            input_ids[r, : len(piece)] = piece
            labels[r, : len(piece) - 1] = piece[1:]
        batches.append({"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)})
    return batches


@dataclass
class TextSource:
    """One evaluation source: its name, where it came from and its tokens."""

    name: str
    path: Path
    kind: str  # "shards" | "jsonl" | "conversations" (masked shards: scored by `conversation_batches`)
    tokens: np.ndarray
    documents: int  # whole documents among `tokens`


def parse_source_spec(spec: str) -> tuple[str | None, Path]:
    """`NAME=PATH` or `PATH` (the name then comes from the path)."""
    name, sep, path = spec.partition("=")
    if sep and name and not Path(spec).exists():
        return name, Path(path)
    return None, Path(spec)


def load_source(spec: str, tokenizer, *, max_tokens: int | None = None, text_field: str = "text") -> TextSource:
    """Tokens of a shard directory (or its `val/` split) or of JSON-lines text, checked against `tokenizer`."""
    name, path = parse_source_spec(spec)
    if path.is_dir() and not (path / shards.MANIFEST).exists() and (path / "val" / shards.MANIFEST).exists():
        path = path / "val"
    if path.is_dir() and (path / shards.MANIFEST).exists():
        tokens = _shard_tokens(path, tokenizer, max_tokens)
        manifest = shards.Manifest.load(path)
        kind = "preference" if manifest.preference else "conversations" if manifest.masked else "shards"
        default_name = path.parent.name if path.name == "val" else path.name
    elif path.is_file() and path.name.endswith(JSONL_SUFFIXES):
        tokens = _jsonl_tokens(path, tokenizer, max_tokens, text_field)
        kind = "jsonl"
        default_name = path.name.split(".")[0]
    elif path.exists():
        raise ValueError(f"{path}: not a shard directory (no {shards.MANIFEST}, nor val/{shards.MANIFEST}) nor a JSON-lines file ({', '.join(JSONL_SUFFIXES)})")
    else:
        raise FileNotFoundError(f"{path}: no such evaluation data")
    if len(tokens) < 2:
        raise ValueError(f"{path}: holds {len(tokens)} tokens; at least 2 are needed for one prediction")
    # Every document ends with EOS, so this also counts right when --max-tokens cut the source short.
    return TextSource(name or default_name, path, kind, tokens, int((tokens == tokenizer.eos_id).sum()))


def _shard_tokens(directory: Path, tokenizer, max_tokens: int | None) -> np.ndarray:
    source = TokenSource(directory)  # checks the manifest against every shard's metadata and size
    if not tokenizer.matches(source.tokenizer_fingerprint):
        raise ValueError(
            f"{directory / shards.MANIFEST}: shards were written with tokenizer {source.tokenizer_fingerprint}, "
            f"but the model's tokenizer {tokenizer.path} is {tokenizer.fingerprint}; their ids mean different text, "
            f"so the loss would be meaningless. Evaluate data prepared with the model's tokenizer."
        )
    if source.max_token_id >= tokenizer.vocab_size:
        raise ValueError(f"{directory}: token id {source.max_token_id} >= the tokenizer's vocab size {tokenizer.vocab_size}")
    tokens = np.empty(min(source.num_tokens, max_tokens or source.num_tokens), dtype=np.int64)
    source.read(0, tokens)
    return tokens


def _jsonl_tokens(path: Path, tokenizer, max_tokens: int | None, text_field: str) -> np.ndarray:
    pieces, total, chunk = [], 0, []

    def flush() -> int:
        n = 0
        for ids in tokenizer.encode_batch(chunk):
            pieces.append(np.asarray(ids + [tokenizer.eos_id], dtype=np.int64))
            n += len(ids) + 1
        chunk.clear()
        return n

    for text in read_texts(path, text_field):
        chunk.append(text)
        if len(chunk) == 256:
            total += flush()
            if max_tokens is not None and total >= max_tokens:
                break
    if chunk:
        flush()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return tokens[:max_tokens] if max_tokens is not None else tokens
