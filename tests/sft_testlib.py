"""Masked (fine-tuning) shard directories from real conversations, for the SFT tests (importable by name).

The conversations of shared/data/chat-sample rendered with OLMo 3's chat template and the dolma2
tokenizer (olmo_ds/chat.py), written with the shard format's own writer (`shards.write_shard` with a
mask, `shards.write_manifest`), as prepare_data.py writes chat data.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from olmo_ds.data import shards

from testdata import SHARED

CHAT = SHARED / "data" / "chat-sample"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"


@functools.cache
def tokenizer():
    from olmo_ds.tokenizer import load_tokenizer

    return load_tokenizer(DOLMA2)


@functools.cache
def encoded(split: str = "train") -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """(ids uint32, mask bool) of every conversation of chat-sample's `split`, in file order."""
    from olmo_ds.chat import ChatEncoder, load_chat_template

    tok = tokenizer()
    enc = ChatEncoder(load_chat_template("olmo3", tok), tok)
    rows = [json.loads(line)["messages"] for line in (CHAT / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
    return tuple((e.ids, e.mask) for e in (enc.encode(m) for m in rows))


class SmallVocab:
    """What `write_manifest` reads of a tokenizer, for conversations whose ids were folded into `vocab_size`."""

    def __init__(self, vocab_size: int, eos_id: int, pad_id: int):
        self.vocab_size, self.eos_id, self.pad_id = vocab_size, eos_id, pad_id
        self.fingerprint = f"sha256:folded-{vocab_size}"


def write_masked_source(directory: Path, conversations, *, tok=None, shard_docs: int = 50, split: str = "train") -> Path:
    """Write `conversations` ([(ids, mask)]) as a masked shard directory, `shard_docs` conversations per shard."""
    tok = tok or tokenizer()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metas = []
    for k, lo in enumerate(range(0, len(conversations), shard_docs)):
        part = conversations[lo:lo + shard_docs]
        ids = np.concatenate([np.asarray(c[0]) for c in part]).astype(shards.dtype_for_vocab(tok.vocab_size))
        mask = np.concatenate([np.asarray(c[1], dtype=bool) for c in part])
        offsets = np.concatenate([[0], np.cumsum([len(c[0]) for c in part])]).astype(np.int64)
        metas.append(shards.write_shard(directory, k, ids, offsets, vocab_size=tok.vocab_size, eos_id=tok.eos_id, mask=mask))
    shards.write_manifest(directory, tok, split, {}, metas)
    return directory


def folded(conversations, vocab_size: int, specials: dict[int, int] | None = None):
    """The conversations with ids folded into a small vocabulary (a tiny model's), masks unchanged."""
    out = []
    for ids, mask in conversations:
        ids = np.asarray(ids, dtype=np.int64)
        small = ids % (vocab_size - 2)
        for big, new in (specials or {}).items():
            small[ids == big] = new
        out.append((small, mask))
    return out
