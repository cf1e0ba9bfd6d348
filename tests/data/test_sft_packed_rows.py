"""Fine-tuning data through the loader: packed rows of whole conversations from masked shards (issue 37 part 3).

Real conversations (shared/data/chat-sample, OLMo 3's template, the dolma2 tokenizer), real shards, the
real loader; resume on another world size. Exactness against transformers and no attention across
conversations: tests/model/test_sft_exactness.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader, validation_batches
from olmo_ds.model.loss import IGNORE_INDEX

from sft_testlib import encoded, write_masked_source
from testdata import SHARED

SEQ = 512


@pytest.fixture(scope="module")
def conversations():
    return list(encoded("train"))


@pytest.fixture(scope="module")
def source(tmp_path_factory, conversations):
    return write_masked_source(tmp_path_factory.mktemp("sft") / "chat", conversations, shard_docs=60)


def loader(source, world=1, rank=0, batch=8, **data):
    cfg = DataConfig(sources=[SourceConfig(path=str(source))], prefetch=0, seed=5, **data)
    return DataLoader(cfg, seq_len=SEQ, global_batch_size=batch, dp_rank=rank, dp_world_size=world)


def conversation_of(ids, conversations):
    """The index of the conversation whose ids start a piece (conversations are unique in the sample)."""
    for k, (c, _) in enumerate(conversations):
        if len(ids) <= len(c) and np.array_equal(c[:len(ids)], ids):
            return k
    raise AssertionError("a piece of a row is no conversation's beginning")


def test_rows_hold_whole_conversations_with_their_masks(source, conversations):
    p = loader(source).sources[0].packing(SEQ)
    L = loader(source, batch=p.num_rows)  # one batch: the whole epoch
    assert L.masked and L.document_masking
    assert L.mixture.epoch_size == p.num_rows and p.num_rows >= p.min_rows
    seen = []
    for _ in range(1):
        b = {k: v.numpy() for k, v in L.next_batch().items()}
        for r in range(p.num_rows):
            ids, labels, pieces = b["input_ids"][r], b["labels"][r], b["doc_lens"][r][b["doc_lens"][r] > 0]
            assert pieces.sum() == SEQ and b["row_tokens"][r] <= SEQ
            pos = 0
            for n in pieces:
                assert np.array_equal(b["positions"][r, pos:pos + n], np.arange(n))  # RoPE restarts per piece
                if pos >= b["row_tokens"][r]:  # the padding: pad_id, no targets
                    assert (ids[pos:] == L.sources[0].pad_id).all() and (labels[pos:] == IGNORE_INDEX).all()
                else:
                    k = conversation_of(ids[pos:pos + n], conversations)
                    c_ids, c_mask = conversations[k]
                    assert n == min(len(c_ids), SEQ)  # whole, or truncated to the row
                    want = np.where(c_mask[1:n], c_ids[1:n].astype(np.int64), IGNORE_INDEX)  # next token's mask (labels_from_mask)
                    assert np.array_equal(labels[pos:pos + n - 1], want) and labels[pos + n - 1] == IGNORE_INDEX
                    seen.append(k)
                pos += n
    # Every conversation placed once in the epoch (each piece above is one conversation's whole beginning).
    assert len(seen) == len(p.doc_index) == len(conversations) and sorted(p.doc_index.tolist()) == list(range(len(conversations)))


def test_long_conversations_drop_and_counts(source, conversations):
    longest = max(len(c) for c, _ in conversations)
    assert longest > SEQ
    drop = loader(source, long_conversations="drop").sources[0].packing(SEQ)
    trunc = loader(source).sources[0].packing(SEQ)
    n_long = sum(len(c) > SEQ for c, _ in conversations)
    assert len(drop.dropped) == n_long and len(trunc.truncated) == n_long and len(trunc.dropped) == 0
    assert loader(source).fingerprint != loader(source, long_conversations="drop").fingerprint
    with pytest.raises(ValueError, match="long_conversations"):
        DataConfig(sources=[SourceConfig(path=str(source))], long_conversations="fragment")


def test_masked_data_refuses_document_masking_off_and_a_mixture_with_plain_data(source, tmp_path):
    with pytest.raises(ValueError, match="data.document_masking: false"):
        loader(source, document_masking=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    tokens = np.arange(1, 2001, dtype=np.uint32) % 1000
    meta = shards.write_shard(plain, 0, tokens, np.array([0, 1000, 2000]), vocab_size=100278, eos_id=100257)
    from sft_testlib import tokenizer
    shards.write_manifest(plain, tokenizer(), "train", {}, [meta])
    cfg = DataConfig(sources=[SourceConfig(path=str(source)), SourceConfig(path=str(plain))], prefetch=0)
    with pytest.raises(ValueError, match=f"{source}.*masked.*{plain}.*no loss mask"):
        DataLoader(cfg, seq_len=SEQ, global_batch_size=4, dp_rank=0, dp_world_size=1)


def test_resume_mid_epoch_on_another_world_size_gives_the_same_batches(source):
    one = loader(source, world=1, batch=16)
    for _ in range(6):
        one.next_batch()
    state = one.state_dict()
    want = [one.next_batch() for _ in range(4)]
    assert one.epoch == 1  # mid-epoch resume, and the next batches cross into the next epoch
    for world in (2, 4):
        parts = []
        for rank in range(world):
            L = loader(source, world=world, rank=rank, batch=16)
            L.load_state_dict(state)
            parts.append([L.next_batch() for _ in range(4)])
        for step in range(4):
            for key in want[step]:
                got = torch.cat([parts[r][step][key] for r in range(world)]) if key != "doc_lens" else None
                if got is not None:
                    assert torch.equal(got, want[step][key]), (world, step, key)


def test_validation_batches_of_a_masked_source_cover_every_row_once(source, conversations):
    rows = loader(source).sources[0].packing(SEQ).num_rows
    batches = list(validation_batches(str(source), SEQ, 3, 0, 1))
    assert sum(int((b["row_tokens"] > 0).sum()) for b in batches) == rows
    targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    # Every trained token but each conversation's first (never trained by the template) and truncated tails.
    want = sum(int(m[1:min(len(c), SEQ)].sum()) for c, m in conversations)
    assert targets == want


def test_a_masked_manifest_without_pad_id_or_a_shard_without_its_mask_is_refused(tmp_path, conversations):
    import json

    src = write_masked_source(tmp_path / "a", conversations[:20], shard_docs=10)
    manifest = json.loads((src / "manifest.json").read_text())
    del manifest["pad_id"]
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json: a masked .* needs an integer pad_id"):
        loader(src)
    src = write_masked_source(tmp_path / "b", conversations[:20], shard_docs=10)
    (src / "shard-00001.mask").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00001.mask: missing"):
        loader(src)
    meta = json.loads((src / "shard-00001.json").read_text())
    for key in ("mask", "mask_checksum", "trained_tokens"):
        del meta[key]
    (src / "shard-00001.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="shard-00001.json: carries no loss mask, but .*manifest.json says masked: true"):
        loader(src)
