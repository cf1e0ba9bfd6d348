"""Preference (DPO) shard directories from real pairs, for the tests (importable by name).

The pairs of shared/data/pref-sample, each side rendered with OLMo 3's chat template and the dolma2
tokenizer and masked to its final assistant reply (`olmo_ds.chat.ChatEncoder`, mask="last"), written with
the shard format's own streaming writer (`shards.ShardedWriter(preference=True)`, `shards.write_manifest`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from olmo_ds.data import shards

from sft_testlib import tokenizer
from testdata import SHARED

PREF = SHARED / "data" / "pref-sample"


@functools.cache
def encoded_pairs(split: str = "train") -> tuple[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], ...]:
    """((chosen ids, chosen mask), (rejected ids, rejected mask)) of every pair of pref-sample's `split`, in file order."""
    from olmo_ds.chat import ChatEncoder, load_chat_template

    tok = tokenizer()
    enc = ChatEncoder(load_chat_template("olmo3", tok), tok, mask="last")
    rows = [json.loads(line) for line in (PREF / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
    out = []
    for row in rows:
        chosen, rejected = enc.encode(row["chosen"]), enc.encode(row["rejected"])
        out.append(((chosen.ids, chosen.mask), (rejected.ids, rejected.mask)))
    return tuple(out)


def write_pref_source(directory: Path, pairs, *, tok=None, shard_tokens: int = 20_000, split: str = "train") -> Path:
    """Write `pairs` ([((ids, mask), (ids, mask))]) as a preference shard directory, shards of at most
    `shard_tokens` tokens cut between pairs."""
    tok = tok or tokenizer()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    docs = [side for pair in pairs for side in pair]
    writer = shards.ShardedWriter(directory, shard_tokens, vocab_size=tok.vocab_size, eos_id=tok.eos_id, masked=True, preference=True)
    writer.add(np.concatenate([np.asarray(ids) for ids, _ in docs]).astype(shards.dtype_for_vocab(tok.vocab_size)),
               np.array([len(ids) for ids, _ in docs], dtype=np.int64),
               mask=np.concatenate([np.asarray(mask, dtype=bool) for _, mask in docs]))
    writer.finish()
    shards.write_manifest(directory, tok, split, {})
    return directory
