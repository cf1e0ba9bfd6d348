"""Preference (DPO) shard directories from real pairs, for the tests (importable by name).

`prepare_pref_source`: shared/data/pref-sample through the real preparation (`prepare_data.py --format
preference`, OLMo 3's chat template, the dolma2 tokenizer). `encoded_pairs`: the same pairs encoded directly
by `olmo_ds.chat.ChatEncoder` (mask="last"), the reference the prepared shards are checked against.
`write_pref_source`: given pairs (e.g. folded into a tiny model's vocabulary, or deliberately broken) written
with the shard format's own streaming writer (`shards.ShardedWriter(preference=True)`, `shards.write_manifest`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from olmo_ds.data import shards

from sft_testlib import DOLMA2, tokenizer
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


def prepare_pref_source(directory: Path, split: str = "train", **options) -> Path:
    """pref-sample's `split` prepared by `prepare_data.py --format preference` into `directory` (`options`: PrepareConfig's)."""
    from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare

    prepare(PrepareConfig(inputs=[str(PREF / f"{split}.jsonl")], output=Path(directory), tokenizer=str(DOLMA2), format="preference",
                          chat_template="olmo3", progress=False, **options), log=lambda _: None)
    return Path(directory)


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
