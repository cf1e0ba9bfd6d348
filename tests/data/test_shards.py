import numpy as np
import pytest

from olmo_ds.data import shards


def test_dtype_follows_vocab():
    assert shards.dtype_for_vocab(50280) == np.uint16
    assert shards.dtype_for_vocab(65536) == np.uint16
    assert shards.dtype_for_vocab(65537) == np.uint32
    assert shards.dtype_for_vocab(100278) == np.uint32


def test_write_then_read_round_trip(tmp_path):
    tokens = np.array([5, 6, 99, 7, 99, 100000, 99], dtype=np.uint32)
    offsets = np.array([0, 3, 5, 7])
    meta = shards.write_shard(tmp_path, 0, tokens, offsets, vocab_size=100278, eos_id=99)
    loaded = shards.ShardMeta.load(shards.meta_path(tmp_path, 0))
    assert loaded == meta and meta.dtype == "uint32" and meta.max_token_id == 100000
    assert meta.checksum == shards.sha256_file(shards.bin_path(tmp_path, 0))
    np.testing.assert_array_equal(shards.open_tokens(shards.bin_path(tmp_path, 0), meta), tokens)
    np.testing.assert_array_equal(shards.load_offsets(shards.offsets_path(tmp_path, 0)), offsets)
    assert not list(tmp_path.glob("*.tmp*")), "temporary files must not survive a complete write"


def test_truncated_shard_is_refused(tmp_path):
    meta = shards.write_shard(tmp_path, 0, np.arange(10, dtype=np.uint16), np.array([0, 10]), vocab_size=50280, eos_id=9)
    path = shards.bin_path(tmp_path, 0)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        shards.open_tokens(path, meta)
