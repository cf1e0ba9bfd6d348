"""The loss-mask part of the shard format: written with a shard, read back as bool, counted, checked."""

import json

import numpy as np
import pytest

from olmo_ds.data import shards


class _Tok:  # what write_manifest reads of a tokenizer
    vocab_size, eos_id, pad_id, fingerprint = 1000, 0, 999, "sha256:test"


def _docs(rng, n):
    lens = rng.integers(2, 40, n)
    tokens = rng.integers(1, 999, int(lens.sum())).astype(np.uint16)
    tokens[np.cumsum(lens) - 1] = 0
    mask = rng.random(len(tokens)) < 0.4
    return tokens, lens, mask


def test_streamed_and_whole_masked_shards_are_identical_and_read_back(tmp_path):
    rng = np.random.default_rng(0)
    tokens, lens, mask = _docs(rng, 200)
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    streamed.mkdir(), whole.mkdir()
    w = shards.ShardedWriter(streamed, 500, vocab_size=1000, eos_id=0, masked=True)
    for part in np.array_split(np.arange(200), 7):  # batches that do not line up with shard ends
        lo, hi = int(lens[: part[0]].sum()), int(lens[: part[-1] + 1].sum())
        w.add(tokens[lo:hi], lens[part], mask=mask[lo:hi])
    w.finish()
    metas = [shards.ShardMeta.load(p.with_suffix(".json")) for p in shards.list_shards(streamed)]
    assert len(metas) > 3 and all(m.masked for m in metas)
    got = np.concatenate([shards.open_mask(streamed / m.mask, m) for m in metas])
    assert got.dtype == bool and np.array_equal(got, mask)
    assert sum(m.trained_tokens for m in metas) == int(mask.sum())
    first = metas[0]
    shards.write_shard(whole, 0, tokens[: first.num_tokens], np.r_[0, np.cumsum(lens)[np.cumsum(lens) <= first.num_tokens]],
                       vocab_size=1000, eos_id=0, mask=mask[: first.num_tokens])
    assert (whole / first.mask).read_bytes() == (streamed / first.mask).read_bytes()
    assert shards.ShardMeta.load(shards.meta_path(whole, 0)) == first
    manifest = shards.write_manifest(streamed, _Tok, "train", {})
    assert manifest.masked and manifest.extra["trained_tokens"] == int(mask.sum())


def test_plain_shards_keep_their_bytes_and_a_mixed_directory_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    tokens, lens, mask = _docs(rng, 20)
    meta = shards.write_shard(tmp_path, 0, tokens, np.r_[0, np.cumsum(lens)], vocab_size=1000, eos_id=0)
    written = json.loads(shards.meta_path(tmp_path, 0).read_text())
    assert not meta.masked and not set(shards.MASK_META) & set(written)  # pretraining metadata unchanged
    assert not shards.write_manifest(tmp_path, _Tok, "train", {}).masked
    shards.write_shard(tmp_path, 1, tokens, np.r_[0, np.cumsum(lens)], vocab_size=1000, eos_id=0, mask=mask)
    with pytest.raises(ValueError, match="some shards carry a loss mask"):
        shards.write_manifest(tmp_path, _Tok, "train", {})


def test_a_mask_of_the_wrong_length_is_refused_naming_the_file(tmp_path):
    rng = np.random.default_rng(2)
    tokens, lens, mask = _docs(rng, 10)
    meta = shards.write_shard(tmp_path, 0, tokens, np.r_[0, np.cumsum(lens)], vocab_size=1000, eos_id=0, mask=mask)
    path = tmp_path / meta.mask
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"shard-00000\.mask.*num_tokens"):
        shards.open_mask(path, meta)
    w = shards.ShardWriter(tmp_path, 1, vocab_size=1000, eos_id=0, masked=True)
    with pytest.raises(ValueError, match="without a mask"):
        w.append(tokens, lens)
    with pytest.raises(ValueError, match="mask values for"):
        w.append(tokens, lens, mask[:-1])
    w.abort()
    assert not list(tmp_path.glob("*.tmp"))
