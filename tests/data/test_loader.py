"""The training data loader: exactly-once coverage, world-size independence, exact resume, clear errors.

Synthetic sources hold token value = position in the source's stream (uint32), so every row tells
which instance it is: row[0] // seq_len.
"""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader, validation_batches
from olmo_ds.data.order import BatchSizeSchedule
from testdata import SHARED

VOCAB = 100278  # uint32 shards, like OLMo 2/3's tokenizer
SEQ = 16


def write_source(directory: Path, shard_sizes, *, vocab_size=VOCAB, eos_id=0, fingerprint="sha256:synthetic", seed=0, values=None) -> Path:
    """Shards whose token at stream position p is p (or values[p]), cut into random documents."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    total = int(sum(shard_sizes))
    stream = np.arange(total) if values is None else np.asarray(values)
    names, start = [], 0
    dtype = shards.dtype_for_vocab(vocab_size)
    for i, n in enumerate(shard_sizes):
        cuts = np.unique(rng.integers(1, n, size=max(1, n // 7))) if n > 1 else np.array([], dtype=np.int64)
        offsets = np.concatenate([[0], cuts, [n]]) if n else np.zeros(1, dtype=np.int64)
        meta = shards.write_shard(directory, i, stream[start : start + n].astype(dtype), offsets, vocab_size=vocab_size, eos_id=eos_id)
        names.append(meta.bin)
        start += n
    shards.Manifest(
        num_tokens=total, num_docs=0, shards=names, dtype=dtype.name, vocab_size=vocab_size, eos_id=eos_id, tokenizer_fingerprint=fingerprint
    ).save(directory)
    return directory


def loader(paths, *, bs=6, rank=0, world=1, seq=SEQ, **cfg):
    sources = [p if isinstance(p, SourceConfig) else SourceConfig(path=str(p)) for p in paths]
    return DataLoader(DataConfig(sources=sources, **cfg), seq_len=seq, global_batch_size=bs, dp_rank=rank, dp_world_size=world)


def instance_ids(batch, seq=SEQ):
    return (batch["input_ids"][:, 0] // seq).tolist()


def global_batches(path, steps, *, world, bs=8, prefetch=2, **kw):
    """The global batches a `world`-rank job sees, rebuilt by concatenating the ranks' slices."""
    ranks = [loader([path], bs=bs, rank=r, world=world, prefetch=prefetch, **kw) for r in range(world)]
    out = []
    for _ in range(steps):
        parts = [ld.next_batch()["input_ids"].numpy() for ld in ranks]
        out.append(np.concatenate(parts))
    for ld in ranks:
        ld.close()
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # 3 shards, 1000 tokens: 62 instances of 16, 8 tail tokens dropped; instances cross shard ends.
    return write_source(tmp_path_factory.mktemp("src"), [300, 333, 367])


def test_instances_are_consecutive_tokens_with_shifted_labels(source):
    ld = loader([source], bs=4, prefetch=0)
    batch = ld.next_batch()
    assert batch["input_ids"].dtype == batch["labels"].dtype == __import__("torch").int64
    for row, labels in zip(batch["input_ids"].numpy(), batch["labels"].numpy()):
        start = row[0]
        assert start % SEQ == 0
        np.testing.assert_array_equal(row, np.arange(start, start + SEQ))
        np.testing.assert_array_equal(labels[:-1], row[1:])
        assert labels[-1] == -100


def test_an_instance_may_span_several_shards_including_an_empty_one(tmp_path):
    d = write_source(tmp_path / "s", [5, 0, 7, 20])
    batch = loader([d], bs=2, prefetch=0, document_masking=True).next_batch()
    np.testing.assert_array_equal(np.sort(batch["input_ids"].numpy(), axis=0), np.arange(32).reshape(2, 16))
    lens = dict(zip(instance_ids(batch), batch["doc_lens"].numpy().tolist()))
    # Shard ends at 5 and 12 are document ends; the documents inside shards come from their offsets.
    cuts = set(np.cumsum([n for n in lens[0] if n]).tolist())
    assert {5, 12, 16} <= cuts


@pytest.mark.parametrize("world", [1, 2, 3])
def test_epoch_is_covered_exactly_once_across_ranks(source, world):
    ranks = [loader([source], bs=6, rank=r, world=world) for r in range(world)]
    assert ranks[0].mixture.epoch_size == 62  # 1000 // 16, the 8-token tail dropped
    seen = []
    for _ in range(62 // 6):  # 10 whole batches: 60 instances
        for ld in ranks:
            batch = ld.next_batch()
            assert batch["input_ids"].shape == (6 // world, SEQ)
            seen += instance_ids(batch)
    assert len(seen) == len(set(seen)) == 60
    assert set(seen) <= set(range(62))
    # The epoch's last 2 instances open the next global batch, which then continues into epoch 1.
    tail = sum((instance_ids(ld.next_batch()) for ld in ranks), [])
    assert set(seen) | set(tail[:2]) == set(range(62))


def test_epoch_boundary_continues_into_a_new_permutation(source):
    ld = loader([source], bs=31, prefetch=0)
    epochs = [instance_ids(ld.next_batch()) + instance_ids(ld.next_batch()) for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(62))
    assert epochs[0] != epochs[1]


def test_global_batches_do_not_depend_on_world_size_or_prefetch(source):
    reference = global_batches(source, 12, world=1, prefetch=0)
    for world, prefetch in [(1, 3), (2, 1), (4, 2), (4, 0)]:
        got = global_batches(source, 12, world=world, prefetch=prefetch)
        for a, b in zip(reference, got):
            np.testing.assert_array_equal(a, b)


def test_seed_changes_the_order(source):
    a = global_batches(source, 2, world=1, seed=0)
    b = global_batches(source, 2, world=1, seed=1)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("stop_at,new_world", [(0, 4), (3, 2), (7, 4), (9, 1)])
def test_resume_equals_uninterrupted_run_also_on_another_world_size(source, stop_at, new_world):
    reference = global_batches(source, 14, world=2)  # crosses the epoch boundary at 62 // 8 = 7.75 steps
    first = [loader([source], bs=8, rank=r, world=2) for r in range(2)]
    for _ in range(stop_at):
        for ld in first:
            ld.next_batch()
    state = json.loads(json.dumps(first[0].state_dict()))  # through JSON, as train_state.json stores it
    assert state == first[1].state_dict()
    resumed = [loader([source], bs=8, rank=r, world=new_world) for r in range(new_world)]
    for ld in resumed:
        ld.load_state_dict(state)
    for step in range(stop_at, 14):
        got = np.concatenate([ld.next_batch()["input_ids"].numpy() for ld in resumed])
        np.testing.assert_array_equal(got, reference[step])
    for ld in first + resumed:
        ld.close()


def test_batch_size_schedule_consumes_each_instance_once_and_resumes_across_a_change(source):
    schedule = BatchSizeSchedule.parse([[0, 2], [3, 4], {"step": 6, "global_batch_size": 8}])
    assert [schedule.at(s) for s in range(8)] == [2, 2, 2, 4, 4, 4, 8, 8]
    assert schedule.instances_before(7) == 6 + 12 + 8
    ref = loader([source], bs=schedule, world=2, rank=0, prefetch=0)
    ref1 = loader([source], bs=schedule, world=2, rank=1, prefetch=0)
    seen, per_step = [], []
    for step in range(10):  # 6 + 12 + 32 = 50 instances, within the 62 of epoch 0
        ids = instance_ids(ref.next_batch()) + instance_ids(ref1.next_batch())
        assert len(ids) == schedule.at(step)
        per_step.append(ids)
        seen += ids
    assert len(seen) == len(set(seen)) == 50
    assert ref.global_batch_instances(8) == [(source.name, i * SEQ) for i in per_step[8]]
    # Stop on the step before the change, resume on 4 ranks: the same batches follow.
    first = loader([source], bs=schedule, prefetch=0)
    for _ in range(5):
        first.next_batch()
    resumed = [loader([source], bs=schedule, rank=r, world=4, prefetch=1) for r in range(4)]
    for ld in resumed:
        ld.load_state_dict(first.state_dict())
    for step in range(5, 10):
        assert sum((instance_ids(ld.next_batch()) for ld in resumed), []) == per_step[step]
    for ld in resumed:
        ld.close()


def test_prefetch_reports_wait_time_and_state_counts_only_returned_batches(source):
    ld = loader([source], bs=4, prefetch=3)
    ld.next_batch()
    ld.next_batch()
    assert ld.state_dict()["step"] == 2 and ld.state_dict()["instances_consumed"] == 8
    assert ld.wait_seconds > 0
    ld.close()


def test_report_counts_the_dropped_tail(source):
    (row,) = loader([source], seq=SEQ).mixture_report(total_instances=124)
    assert row["tokens_on_disk"] == 1000 and row["dropped_tail_tokens"] == 8 and row["instances"] == 62
    assert row["run_source_epochs"] == 2.0 and row["run_tokens"] == 124 * SEQ


def test_validation_stream_covers_every_instance_once_in_order(source):
    seen, shapes = [], set()
    batches = [list(validation_batches(str(source), SEQ, 5, r, 3)) for r in range(3)]
    assert len({len(b) for b in batches}) == 1  # every rank runs the same number of batches
    for step in range(len(batches[0])):
        for r in range(3):
            batch = batches[r][step]
            shapes.add(tuple(batch["input_ids"].shape))
            real = (batch["labels"] != -100).any(dim=1)
            seen += instance_ids({"input_ids": batch["input_ids"][real]})
    assert seen == list(range(62)) and shapes == {(5, SEQ)}


def test_document_lengths_match_the_shards_offsets(source):
    ld = loader([source], bs=62, prefetch=0, document_masking=True)
    batch = ld.next_batch()
    # Document boundaries in stream positions, from the offsets files (shard ends included).
    bounds, base = set(), 0
    for i in range(3):
        offs = shards.load_offsets(shards.offsets_path(source, i))
        bounds |= set((base + offs).tolist())
        base += int(offs[-1])
    for row, lens in zip(batch["input_ids"].numpy(), batch["doc_lens"].numpy()):
        assert lens.sum() == SEQ and (lens[lens > 0].size == np.count_nonzero(lens))
        lens = lens[lens > 0]
        cuts = int(row[0]) + np.cumsum(lens)[:-1]
        expected = sorted(b for b in bounds if row[0] < b < row[0] + SEQ)
        assert cuts.tolist() == expected


def test_document_lengths_from_a_real_tokenizer(tmp_path):
    from olmo_ds.tokenizer import load_tokenizer

    tok = load_tokenizer(SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json")
    with gzip.open(SHARED / "data" / "c4-sample" / "c4-sample.01.json.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f][:6]
    docs = [ids + [tok.eos_id] for ids in tok.encode_batch(texts)]
    tokens = np.concatenate([np.asarray(d) for d in docs])
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    shards.write_shard(tmp_path, 0, tokens.astype(np.uint16), offsets, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    shards.Manifest(
        num_tokens=len(tokens), num_docs=len(docs), shards=["shard-00000.bin"], dtype="uint16",
        vocab_size=tok.vocab_size, eos_id=tok.eos_id, tokenizer_fingerprint=tok.fingerprint,
    ).save(tmp_path)
    seq = 64
    batches = list(validation_batches(str(tmp_path), seq, 4, 0, 1, document_masking=True))
    stream = np.concatenate([b["input_ids"].numpy().ravel() for b in batches])
    n = len(tokens) // seq
    np.testing.assert_array_equal(stream[: n * seq], tokens[: n * seq])
    lens = np.concatenate([b["doc_lens"].numpy().ravel() for b in batches])
    ends = np.cumsum(lens[lens > 0])[: -1]
    # Every cut is a document end (the token before it is EOS), and every EOS is a cut or a row end.
    window = stream[: n * seq]
    assert all(window[e - 1] == tok.eos_id for e in ends if e <= n * seq and e % seq)
    eos_positions = set((np.flatnonzero(window == tok.eos_id) + 1).tolist())
    assert eos_positions <= set(ends.tolist()) | {n * seq}


# Errors before step one.
def test_missing_shard_is_named(tmp_path):
    d = write_source(tmp_path / "s", [100, 100])
    shards.bin_path(d, 1).unlink()
    with pytest.raises(FileNotFoundError, match="shard-00001.bin: missing"):
        loader([d])


def test_truncated_bin_is_named(tmp_path):
    d = write_source(tmp_path / "s", [100, 100])
    p = shards.bin_path(d, 0)
    p.write_bytes(p.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"shard-00000.bin.*truncated"):
        loader([d])


def test_mixed_dtypes_and_tokenizers_in_one_source_are_refused(tmp_path):
    d = write_source(tmp_path / "s", [100, 100])
    shards.write_shard(d, 1, np.arange(100, dtype=np.uint16), np.array([0, 100]), vocab_size=50280, eos_id=0)
    with pytest.raises(ValueError, match="shard-00001.json: dtype uint16 differs"):
        loader([d])
    d2 = write_source(tmp_path / "t", [100, 100])
    shards.write_shard(d2, 1, np.arange(100, dtype=np.uint32), np.array([0, 100]), vocab_size=VOCAB, eos_id=7)
    with pytest.raises(ValueError, match="shard-00001.json.*different tokenizers"):
        loader([d2])


def test_sources_of_different_tokenizers_are_refused(tmp_path):
    a = write_source(tmp_path / "a", [100])
    b = write_source(tmp_path / "b", [100], fingerprint="sha256:other")
    with pytest.raises(ValueError, match="tokenized differently"):
        loader([a, b])


def test_seq_len_the_data_cannot_fill(tmp_path):
    d = write_source(tmp_path / "s", [50, 40])
    with pytest.raises(ValueError, match="90 tokens cannot fill even one instance of seq_len 128"):
        loader([d], seq=128)


def test_an_id_beyond_the_tokenizer_is_named(tmp_path):
    d = write_source(tmp_path / "s", [100], vocab_size=50280, values=np.r_[np.zeros(99), 60000])
    with pytest.raises(ValueError, match="shard-00000.json: max_token_id 60000 >= vocab_size 50280"):
        loader([d])


def test_model_vocab_smaller_than_the_data(tmp_path):
    d = write_source(tmp_path / "s", [100], values=np.r_[np.zeros(99), 70000])
    ld = loader([d])
    assert ld.max_token_id == 70000
    ld.check_vocab(70001)
    with pytest.raises(ValueError, match="token id 70000.*vocab_size is 50304"):
        ld.check_vocab(50304)


def test_batch_size_not_divisible_by_world_size(source):
    with pytest.raises(ValueError, match="global batch size 6 .* not divisible .* 4"):
        loader([source], bs=BatchSizeSchedule.parse({0: 4, 10: 6}), world=4)
    ld = loader([source], bs=BatchSizeSchedule.parse({0: 2, 10: 8}), world=4)
    with pytest.raises(ValueError, match="global batch size 2 .* not divisible .* 4"):
        ld.next_batch()


def test_resume_on_different_data_is_refused_unless_allowed(tmp_path, source):
    ld = loader([source], bs=4, prefetch=0)
    ld.next_batch()
    state = ld.state_dict()
    other = write_source(tmp_path / "other", [300, 333, 367], values=np.arange(1000) + 1)
    with pytest.raises(ValueError, match="refusing to resume on different data.*fingerprint"):
        loader([other], bs=4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: checkpoint 0, now 5"):
        loader([source], bs=4, seed=5).load_state_dict(state)
    changed = loader([other], bs=4, prefetch=0, allow_data_change=True)
    changed.load_state_dict(state)
    assert changed.step == 1 and changed.instances_consumed == 4


def test_large_epoch_order_is_cached_on_disk_and_equal(tmp_path, source):
    from olmo_ds.data.order import GlobalOrder

    ld = loader([source], prefetch=0)
    in_memory = GlobalOrder(ld.mixture, seed=3)
    cached = GlobalOrder(ld.mixture, seed=3, key="k", cache_dir=tmp_path, cache_min_instances=1)
    np.testing.assert_array_equal(cached.ids(50, 30), in_memory.ids(50, 30))  # crosses into epoch 1
    assert cached.cache_path(0).exists() and cached.cache_path(1).exists()
    again = GlobalOrder(ld.mixture, seed=3, key="k", cache_dir=tmp_path, cache_min_instances=1)
    assert isinstance(again.epoch(0), np.memmap)  # read back, not recomputed
    np.testing.assert_array_equal(again.epoch(1), in_memory.epoch(1))


def test_document_index_that_does_not_span_its_shard_is_named(tmp_path):
    d = write_source(tmp_path / "s", [100, 100])
    np.save(shards.offsets_path(d, 1), np.array([0, 40, 90], dtype=np.int64))
    with pytest.raises(ValueError, match=r"shard-00001.offsets.npy: expected \d+ offsets from 0 to 100"):
        loader([d])


def test_bench_data_measures_on_generated_shards(tmp_path):
    from olmo_ds.tools.bench_data import generate_shards, run

    d = generate_shards(tmp_path, 1 << 16, shard_tokens=1 << 14, mean_doc_len=100)
    assert len(shards.Manifest.load(d).shards) == 4
    result = run(d, seq_len=256, rows_per_rank=2, world_size=2, steps=20, document_masking=True, gpu_tokens_per_s=1e8, cold=True)
    assert result["tokens_per_s"] > 0 and 0 <= result["wait_fraction"] < 1


def test_bench_data_compares_file_counts_holding_no_descriptor_per_file(tmp_path):
    from olmo_ds.tools.bench_data import compare_file_counts

    result = compare_file_counts(tmp_path, [2, 40], 1 << 16, seq_len=256, rows_per_rank=2, world_size=2, steps=5, rounds=2, document_masking=True)
    assert [f["shards"] for f in result["files"].values()] == [2, 40]
    assert all(f["open_fds_after_opening"] == 0 and f["tokens_per_s_median"] > 0 for f in result["files"].values())
    assert result["files"]["2"]["ratio_to_first"] == 1.0


def test_a_read_error_in_the_prefetch_thread_reaches_the_trainer(source, monkeypatch):
    from olmo_ds.data.dataset import TokenSource

    ld = loader([source], bs=2, prefetch=1)
    ld.next_batch()

    def failing_read(self, start, out):
        raise OSError(f"{self.directory}: Input/output error")

    monkeypatch.setattr(TokenSource, "read", failing_read)
    with pytest.raises(OSError, match="Input/output error"):
        for _ in range(4):  # one or two batches may already be prefetched
            ld.next_batch()
    assert ld._thread is None  # stopped, not left blocked on a full queue


def test_validation_source_is_checked_when_asked_for_not_when_iterated(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        validation_batches(str(tmp_path / "absent"), SEQ, 2, 0, 1)


# A token id beyond the vocabulary inside a shard whose metadata was not updated (issue 35, item 4).
def real_shards(directory: Path, sizes=(3, 4, 5)) -> tuple[Path, object]:
    """Shards of c4 documents tokenized by a real tokenizer (uint16 ids), `sizes` documents per shard."""
    from olmo_ds.tokenizer import load_tokenizer

    tok = load_tokenizer(SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json")
    with gzip.open(SHARED / "data" / "c4-sample" / "c4-sample.01.json.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f][: sum(sizes)]
    docs = [np.asarray(ids + [tok.eos_id]) for ids in tok.encode_batch(texts)]
    directory.mkdir(parents=True)
    metas, first = [], 0
    for i, n in enumerate(sizes):
        part = docs[first : first + n]
        first += n
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in part])])
        metas.append(shards.write_shard(directory, i, np.concatenate(part).astype(np.uint16), offsets, vocab_size=tok.vocab_size, eos_id=tok.eos_id))
    shards.Manifest(
        num_tokens=sum(m.num_tokens for m in metas), num_docs=sum(m.num_docs for m in metas), shards=[m.bin for m in metas],
        dtype="uint16", vocab_size=tok.vocab_size, eos_id=tok.eos_id, tokenizer_fingerprint=tok.fingerprint,
    ).save(directory)
    return directory, tok


def put_id(directory: Path, shard: int, token: int, value: int) -> None:
    """Overwrite one id of a shard's token file in place, leaving its metadata (max_token_id, checksum) as it was."""
    ids = np.fromfile(shards.bin_path(directory, shard), dtype="<u2")
    ids[token] = value
    ids.tofile(shards.bin_path(directory, shard))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_id_beyond_the_vocabulary_inside_a_shard_stops_at_its_batch_naming_the_shard(tmp_path, prefetch):
    d, tok = real_shards(tmp_path / "c4")
    meta = shards.ShardMeta.load(shards.meta_path(d, 1))
    offsets = np.load(shards.offsets_path(d, 1))
    token = int(offsets[2]) + 5  # inside document 2 of shard 1
    put_id(d, 1, token, tok.vocab_size)
    seq, bs = 64, 4
    ld = loader([d], bs=bs, seq=seq, prefetch=prefetch)
    ld.check_vocab(tok.vocab_size)  # the metadata still says every id fits: this check cannot see it
    position = int(ld.sources[0].starts[1]) + token  # in the source's stream
    bad_step = next(s for s in range(100) if any(start <= position < start + seq for _, start in ld.global_batch_instances(s)))
    for _ in range(bad_step):
        ld.next_batch()
    with pytest.raises(ValueError) as err:  # a DataError, which pretrain.py prints as one line
        ld.next_batch()
    assert type(err.value).__name__ == "DataError"
    message = str(err.value)
    assert f"{shards.bin_path(d, 1)} holds token id {tok.vocab_size} at token {token} (document 2 of that shard)" in message
    assert f"vocab_size is {tok.vocab_size}" in message and f"max_token_id {meta.max_token_id}" in message
    assert ld.step == bad_step  # the bad batch was never handed out
    ld.close()


def test_an_id_beyond_the_vocabulary_in_a_validation_source_is_named(tmp_path):
    d, tok = real_shards(tmp_path / "c4")
    put_id(d, 2, 0, 65535)
    with pytest.raises(ValueError, match=rf"shard-00002.bin holds token id 65535 at token 0 \(document 0 of that shard\)"):
        list(validation_batches(str(d), 64, 4, 0, 1))


@pytest.mark.slow  # ~30 s: a real 1-rank DeepSpeed run
def test_an_id_beyond_the_vocabulary_ends_a_training_run_with_one_line_before_its_step(tmp_path):
    """A 1-rank CPU run of scripts/pretrain.py: exit 2, one line naming the shard, no traceback, and no
    step trained on the bad batch (metrics.jsonl ends at the step before it)."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from train_testlib import ROOT, launch_env, losses_by_step, tiny_config, write_config, write_markov_shards

    d = write_markov_shards(tmp_path / "data", 20_000)
    cfg = tiny_config(tmp_path, d, max_steps=10, checkpoint={"every": 100, "save_final": False}, logging={"every": 1, "tensorboard": False})
    probe = loader([d], bs=cfg["batch"]["global_batch_size"], seq=cfg["batch"]["seq_len"], seed=cfg["data"]["seed"])
    bad_step = 6  # steps are counted from 1: the batch of loader step 5
    _, start = probe.global_batch_instances(bad_step - 1)[3]
    shard = int(np.searchsorted(probe.sources[0].starts, start + 7, side="right")) - 1
    put_id(d, shard, start + 7 - int(probe.sources[0].starts[shard]), 300)  # vocab_size 256, uint16 shards
    env = {**launch_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29547"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(write_config(tmp_path / "c.yaml", cfg))],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{shards.bin_path(d, shard)} holds token id 300" in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "IndexError" not in run.stderr
    assert sorted(losses_by_step(cfg["run_dir"])) == list(range(1, bad_step)), "trained on the bad batch or stopped early"


# Open files (issue 36, item 3): the loader keeps no descriptor per shard file.
FD_CHILD = r"""
import os, resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # soft and hard: nothing can raise it back
from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader, validation_batches
from olmo_ds.data.validate import validate_directory

d, seq, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
before = len(os.listdir("/proc/self/fd"))
ld = DataLoader(DataConfig(sources=[SourceConfig(path=d)], document_masking=True, prefetch=2),
                seq_len=seq, global_batch_size=100, dp_rank=0, dp_world_size=1)
names = ld.sources[0].manifest.shards
read = set()
for step in range(files // 100):  # one epoch: instance i is shard i, whole
    batch = ld.next_batch()
    for row, (_, start) in zip(batch["input_ids"].numpy(), ld.global_batch_instances(step)):
        k = start // seq
        assert (row == np.fromfile(os.path.join(d, names[k]), dtype=ld.sources[0].dtype)).all(), names[k]
        read.add(k)
held = len(os.listdir("/proc/self/fd")) - before
ld.close()
assert read == set(range(files)), len(read)
val = sum(int((b["labels"] != -100).sum()) for b in validation_batches(d, seq, 50, 0, 1, document_masking=True))
report = validate_directory(d, workers=2)
assert report.ok, [s.errors for s in report.shards if not s.ok][:3] + report.errors
print(f"files {files} read {len(read)} held_fds {held} val_tokens {val} validated {len(report.shards)}")
"""


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """2,000 shards of 64 random ids (uint16) in documents that end in EOS, as validate_shards wants them."""
    d = tmp_path_factory.mktemp("many") / "src"
    d.mkdir()
    rng = np.random.default_rng(0)
    metas = []
    for i in range(2000):
        offsets = np.concatenate([[0], np.unique(rng.integers(1, 64, 3)), [64]])
        ids = rng.integers(1, 50280, 64).astype(np.uint16)
        ids[offsets[1:] - 1] = 0
        metas.append(shards.write_shard(d, i, ids, offsets, vocab_size=50280, eos_id=0))
    shards.Manifest(num_tokens=2000 * 64, num_docs=sum(m.num_docs for m in metas), shards=[m.bin for m in metas], dtype="uint16",
                    vocab_size=50280, eos_id=0, tokenizer_fingerprint="sha256:synthetic").save(d)
    return d


def test_2000_shard_files_train_validate_and_check_under_ulimit_256(many_files):
    """Every shard file read whole into a training batch, a validation pass and validate_shards, in a
    process whose open-file limit is 256 (soft and hard); the old loader held two descriptors per file."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FD_CHILD, str(many_files), "64", "2000"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = dict(zip(*[iter(run.stdout.split())] * 2))
    assert stats["read"] == stats["validated"] == "2000", run.stdout
    assert int(stats["held_fds"]) <= 4, run.stdout  # the prefetch thread's and numpy's own, not one per file
    assert int(stats["val_tokens"]) == 2000 * 64 - 2000  # every instance's labels but its last position


RLIMIT_CHILD = r"""
import logging, resource, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
from olmo_ds.data.dataset import TokenSource
TokenSource(sys.argv[1]); TokenSource(sys.argv[1])
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)
"""


def test_the_soft_open_file_limit_is_raised_to_the_hard_one_once_logged(source):
    import resource
    import subprocess
    import sys

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] in (resource.RLIM_INFINITY, 64):
        pytest.skip("the hard open-file limit is unlimited or 64 here: nothing to raise to")
    run = subprocess.run([sys.executable, "-c", RLIMIT_CHILD, str(source)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-3000:]
    assert run.stderr.count("open-file limit raised from 64 to the hard limit") == 1, run.stderr
