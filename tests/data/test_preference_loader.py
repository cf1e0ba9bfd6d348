"""Preference (DPO) data through the read path: shards of pairs, rows of whole pairs, `pair_ids`, resume (issue 45).

Real pairs (shared/data/pref-sample prepared by `prepare_data.py --format preference`: OLMo 3's template, the
dolma2 tokenizer, each side masked to its final reply), checked against the pairs encoded directly; the real loader.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader, validation_batches
from olmo_ds.data.packing import LongPairError, pack_pairs
from olmo_ds.model.loss import IGNORE_INDEX

from pref_testlib import encoded_pairs, prepare_pref_source
from sft_testlib import encoded, tokenizer, write_masked_source

SEQ = 1024


@pytest.fixture(scope="module")
def pairs():
    return encoded_pairs("train")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return prepare_pref_source(tmp_path_factory.mktemp("pref") / "pairs", shard_tokens=20_000)


def loader(*sources, world=1, rank=0, batch=8, long_pairs="drop", **data):
    cfg = DataConfig(sources=[SourceConfig(path=str(s)) for s in sources], prefetch=0, seed=3, long_pairs=long_pairs, **data)
    return DataLoader(cfg, seq_len=SEQ, global_batch_size=batch, dp_rank=rank, dp_world_size=world)


def fits(pairs):
    return [j for j, (c, r) in enumerate(pairs) if len(c[0]) + len(r[0]) <= SEQ]


def check_row(b: dict, r: int, pairs, offset: int = 0) -> list[int]:
    """Row r of batch `b` holds, in order, each of its pairs' chosen then rejected conversation, whole, with the
    labels of its final reply; then padding. Returns the row's pair ids."""
    ids, labels, positions = b["input_ids"][r], b["labels"][r], b["positions"][r]
    pieces = b["doc_lens"][r][b["doc_lens"][r] > 0]
    row_pairs = b["pair_ids"][r][b["pair_ids"][r] >= 0].tolist()
    assert (b["pair_ids"][r][len(row_pairs):] == -1).all()
    assert pieces.sum() == SEQ and len(pieces) in (2 * len(row_pairs), 2 * len(row_pairs) + 1)
    pos = 0
    for d, n in enumerate(pieces[:2 * len(row_pairs)]):
        want_ids, want_mask = pairs[row_pairs[d // 2] - offset][d % 2]  # document d: pair d // 2, side d % 2 (0 chosen)
        assert n == len(want_ids) and np.array_equal(ids[pos:pos + n], want_ids)
        want = np.where(want_mask[1:], want_ids[1:].astype(np.int64), IGNORE_INDEX)
        assert np.array_equal(labels[pos:pos + n - 1], want) and labels[pos + n - 1] == IGNORE_INDEX
        assert np.array_equal(positions[pos:pos + n], np.arange(n))
        pos += n
    assert pos == b["row_tokens"][r]
    assert (labels[pos:] == IGNORE_INDEX).all()
    return row_pairs


def test_rows_hold_whole_pairs_chosen_first_with_their_pair_ids(source, pairs):
    p = loader(source).sources[0].packing(SEQ)
    L = loader(source, batch=p.num_rows)  # one batch: the whole epoch
    assert L.preference and L.masked and L.document_masking and L.num_pairs == len(pairs)
    assert L.pair_offsets.tolist() == [0]
    b = {k: v.numpy() for k, v in L.next_batch().items()}
    assert b["pair_ids"].dtype == np.int64 and b["pair_ids"].shape[0] == p.num_rows
    assert b["pair_ids"].shape[1] == max(len(p.row_pairs(r)) for r in range(p.num_rows))
    seen = [j for r in range(p.num_rows) for j in check_row(b, r, pairs)]
    assert sorted(seen) == fits(pairs)  # every pair that fits a row, once, whole
    assert p.efficiency > 0.9


def test_each_side_trains_only_its_final_reply(pairs):
    for (c_ids, c_mask), (r_ids, r_mask) in pairs:
        for ids, mask in ((c_ids, c_mask), (r_ids, r_mask)):
            first = int(np.argmax(mask))
            assert mask[first:].all() and not mask[:first].any()  # one run, to the EOS
        first = int(np.argmax(c_mask))
        assert first == int(np.argmax(r_mask)) and np.array_equal(c_ids[:first], r_ids[:first])  # the shared prompt


def test_a_pair_longer_than_a_row_is_refused_naming_it_or_dropped_and_counted(source, pairs):
    long = [j for j, (c, r) in enumerate(pairs) if len(c[0]) + len(r[0]) > SEQ]
    assert long
    with pytest.raises(ValueError, match=rf"data source 'pairs' \({source}\): pair {long[0]} \(documents {2 * long[0]} and "
                                         rf"{2 * long[0] + 1} of shard-00000.bin\) has \d+ tokens .* {len(long)} pairs .*data.long_pairs: drop"):
        loader(source, long_pairs="refuse")
    L = loader(source)
    report = L.mixture_report()[0]["packing"]
    assert report["dropped_pairs"] == len(long) and report["pairs"] == len(pairs) - len(long) and report["long_pairs"] == "drop"
    assert loader(source).fingerprint != DataLoader(DataConfig(sources=[SourceConfig(path=str(source))], prefetch=0, seed=3),
                                                     seq_len=16_384, global_batch_size=8, dp_rank=0, dp_world_size=1).fingerprint
    with pytest.raises(ValueError, match="data.long_pairs 'truncate': expected refuse .* or drop"):
        DataConfig(sources=[SourceConfig(path=str(source))], long_pairs="truncate")


def test_pair_ids_are_global_over_the_sources(tmp_path, source, pairs):
    second = prepare_pref_source(tmp_path / "second", "val", shard_tokens=8_000)
    val = encoded_pairs("val")
    L = loader(source, second, batch=16)
    assert L.pair_offsets.tolist() == [0, len(pairs)] and L.num_pairs == len(pairs) + len(val)
    seen = set()
    for _ in range(L.mixture.epoch_size // 16):
        b = {k: v.numpy() for k, v in L.next_batch().items()}
        for r in range(16):
            ids = b["pair_ids"][r][b["pair_ids"][r] >= 0]
            offset = len(pairs) if ids.min() >= len(pairs) else 0
            assert (ids >= len(pairs)).all() == bool(offset)  # a row is one source's
            check_row(b, r, val if offset else pairs, offset)
            seen.update(ids.tolist())
    assert seen <= set(fits(pairs)) | {len(pairs) + j for j in fits(val)} and max(seen) >= len(pairs)


def test_a_preference_source_mixes_with_neither_chat_nor_plain_data(tmp_path, source):
    chat = write_masked_source(tmp_path / "chat", list(encoded("train"))[:30], shard_docs=10)
    for sources in ((source, chat), (chat, source)):
        with pytest.raises(ValueError, match=rf"{source} \(preference pairs: DPO\) and {chat} \(fine-tuning conversations\) in one mixture"):
            loader(*sources)
    plain = tmp_path / "plain"
    plain.mkdir()
    meta = shards.write_shard(plain, 0, np.arange(1, 2001, dtype=np.uint32), np.array([0, 1000, 2000]), vocab_size=100278, eos_id=100257)
    shards.write_manifest(plain, tokenizer(), "train", {}, [meta])
    with pytest.raises(ValueError, match="in one mixture"):
        loader(source, plain)


def test_resume_mid_epoch_on_another_world_size_gives_the_same_pairs(source):
    one = loader(source, batch=8)
    for _ in range(one.mixture.epoch_size // 8 - 2):
        one.next_batch()
    state = one.state_dict()
    want = [one.next_batch() for _ in range(4)]
    assert one.epoch == 1  # the next batches cross into the next epoch
    for world in (2, 4):
        parts = []
        for rank in range(world):
            L = loader(source, world=world, rank=rank, batch=8)
            L.load_state_dict(state)
            parts.append([L.next_batch() for _ in range(4)])
        for step in range(4):
            for key in ("input_ids", "labels", "positions", "row_tokens"):
                assert torch.equal(torch.cat([parts[r][step][key] for r in range(world)]), want[step][key]), (world, step, key)
            rows = [row[row >= 0].tolist() for r in range(world) for row in parts[r][step]["pair_ids"]]
            assert rows == [row[row >= 0].tolist() for row in want[step]["pair_ids"]], (world, step)


def test_validation_batches_of_pairs_cover_every_pair_once(source, pairs):
    got = []
    for rank in range(2):
        for b in validation_batches(str(source), SEQ, 3, rank, 2, long_pairs="drop"):
            assert set(b) == {"input_ids", "labels", "doc_lens", "positions", "row_tokens", "pair_ids"}
            for r in range(3):
                if b["row_tokens"][r] == 0:  # a padding row: no pairs, no targets
                    assert (b["pair_ids"][r] == -1).all() and (b["labels"][r] == IGNORE_INDEX).all()
                else:
                    got += check_row({k: v.numpy() for k, v in b.items()}, r, pairs)
    assert sorted(got) == fits(pairs)
    with pytest.raises(ValueError, match="pair .* more than a row"):
        validation_batches(str(source), SEQ, 3, 0, 1)


def test_pairs_never_span_shards_and_the_metadata_counts_them(source, pairs):
    m = shards.Manifest.load(source)
    assert m.preference and m.masked and m.extra["pairs"] == len(pairs) and m.num_docs == 2 * len(pairs)
    metas = [shards.ShardMeta.load(p.with_suffix(".json")) for p in shards.list_shards(source)]
    assert len(metas) > 5 and all(meta.preference and meta.num_docs == 2 * meta.pairs for meta in metas)
    offsets = np.cumsum([0] + [meta.num_docs for meta in metas])
    docs = [side for pair in pairs for side in pair]
    for k, meta in enumerate(metas):  # each shard: whole pairs, in input order
        lens = np.diff(shards.load_offsets(shards.offsets_path(source, k)))
        assert lens.tolist() == [len(ids) for ids, _ in docs[offsets[k]:offsets[k + 1]]]


def test_odd_documents_or_a_shard_without_pairs_are_refused(tmp_path, source, pairs):
    (c, r), tok = pairs[0], tokenizer()
    w = shards.ShardWriter(tmp_path, 0, vocab_size=tok.vocab_size, eos_id=tok.eos_id, masked=True, preference=True)
    w.append(np.asarray(c[0], np.uint32), np.array([len(c[0])]), c[1])
    with pytest.raises(ValueError, match=r"shard-00000.json: a preference shard of 1 documents: .* even"):
        w.close()
    w.abort()
    with pytest.raises(ValueError, match="pairs are added whole"):
        shards.ShardedWriter(tmp_path, 1000, vocab_size=tok.vocab_size, eos_id=tok.eos_id, masked=True, preference=True).add(
            np.asarray(c[0], np.uint32), np.array([len(c[0])]), mask=c[1])
    with pytest.raises(ValueError, match="needs a loss mask"):
        shards.write_shard(tmp_path, 0, np.asarray(c[0], np.uint32), np.array([0, len(c[0])]), vocab_size=tok.vocab_size,
                           eos_id=tok.eos_id, preference=True)
    meta = json.loads(shards.meta_path(source, 1).read_text())
    del meta["preference"], meta["pairs"]
    broken = tmp_path / "broken"
    import shutil
    shutil.copytree(source, broken)
    shards.meta_path(broken, 1).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"shard-00001.json: preference None, pairs None for \d+ documents, but .*manifest.json says preference: true"):
        loader(broken)


def test_pack_pairs_places_both_sides_together_best_fit_decreasing():
    p = pack_pairs([3, 5, 2, 4], [3, 1, 2, 5], 10)
    assert p.paired and p.num_rows == 3 and p.tokens == 25
    for r in range(p.num_rows):  # chosen then rejected of each pair, adjacent
        docs = p.row(r)
        assert (docs[0::2] % 2 == 0).all() and (docs[1::2] == docs[0::2] + 1).all()
    assert [p.row_pairs(r).tolist() for r in range(3)] == [[3], [0, 2], [1]]  # 9; 6 then 4 fills the row; 6
    with pytest.raises(LongPairError, match="pair 1 has 12 tokens .* seq_len 11 .*1 such pairs"):
        pack_pairs([3, 6, 2], [3, 6, 2], 11)
    d = pack_pairs([3, 6, 2], [3, 6, 2], 11, "drop")
    assert d.dropped.tolist() == [2, 3] and d.summary()["dropped_pairs"] == 1 and d.summary()["pairs"] == 2


def test_chat_sources_are_unchanged_by_pairs(tmp_path):
    """Chat shards' metadata, manifest and fingerprint record carry none of the preference keys (fingerprints unchanged)."""
    chat = write_masked_source(tmp_path / "chat", list(encoded("train"))[:30], shard_docs=10)
    meta = json.loads(shards.meta_path(chat, 0).read_text())
    assert not {"preference", "pairs"} & set(meta) and not {"preference", "pairs"} & set(json.loads((chat / "manifest.json").read_text()))
    L = loader(chat)
    assert not L.preference and L.num_pairs == 0 and "pair_ids" not in L.next_batch()
    assert set(L.sources[0].fingerprint_record()) == {"tokenizer_fingerprint", "shards", "masks", "long_docs"}
