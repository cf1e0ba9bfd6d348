"""RL prompts through the read path (issue 52): batches of prompts with their verifiers and ground truths, a global
`prompt_index` stable across epochs, ranks and resumes, exact resume on another world size, validation shares, and
the refusals (mixing with other data, prompts too long for seq_len, a changed sidecar).

Real prompts: the fixture set (tests/data/rl_fixtures) prepared by `prepare_data.py --format rl` with OLMo 3's
template and the dolma2 tokenizer, checked against the rows encoded directly; the real loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from olmo_ds.chat import ChatEncoder, load_chat_template
from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader, validation_batches, validation_prompts
from olmo_ds.data.prepare import rl_prompts
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.eval import verifiers
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
FIXTURES = Path(__file__).resolve().parent / "rl_fixtures"
SEQ = 512


def prepare_prompts(inputs, out: Path, **kw) -> Path:
    prepare(PrepareConfig(inputs=[str(i) for i in inputs], output=out, tokenizer=str(DOLMA2), format="rl", chat_template="olmo3",
                          check_ground_truth=verifiers.check, progress=False, **kw), log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two prompt sources: the fixtures' train rows (several shards) and 40 more arithmetic rows."""
    d = tmp_path_factory.mktemp("rl")
    rl_prompts.write_jsonl(d / "more.jsonl", rl_prompts.Arithmetic(10, 20).rows(40, seed=9))
    return (prepare_prompts([FIXTURES / "train.jsonl"], d / "train", shard_tokens=1000),
            prepare_prompts([d / "more.jsonl"], d / "more"), d)


def encoded(path: Path) -> list[tuple[list[int], dict]]:
    tok = load_tokenizer(str(DOLMA2))
    enc = ChatEncoder(load_chat_template("olmo3", tok), tok)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(enc.encode_prompt(r["messages"]), r) for r in rows]


def loader(*srcs, world=1, rank=0, batch=8, **data):
    """Weights in proportion to the sources' prompts (36 and 40), so that a mixture epoch shows each prompt once."""
    weights = {"train": 36, "more": 40}
    cfg = DataConfig(sources=[SourceConfig(path=str(s), weight=weights.get(Path(s).name, 1)) for s in srcs], prefetch=0, seed=3, **data)
    return DataLoader(cfg, seq_len=SEQ, global_batch_size=batch, dp_rank=rank, dp_world_size=world)


def test_batches_hold_prompts_their_verifiers_and_ground_truths(sources):
    train, more, d = sources
    want = encoded(FIXTURES / "train.jsonl") + encoded(d / "more.jsonl")
    L = loader(train, more, batch=4)
    assert L.prompts and not L.masked and L.num_prompts == 76 and L.prompt_offsets.tolist() == [0, 36]
    assert L.verifiers == {"gsm8k": 64, "ifeval": 8, "math": 4}
    seen = []
    for _ in range(19):  # one epoch: 76 prompts
        b = L.next_batch()
        assert set(b) == {"prompt_ids", "prompt_index", "verifier", "ground_truth"}
        assert b["prompt_index"].dtype == torch.long and b["prompt_index"].shape == (4,)
        for ids, k, verifier, gt in zip(b["prompt_ids"], b["prompt_index"].tolist(), b["verifier"], b["ground_truth"]):
            want_ids, row = want[k]
            assert ids == want_ids and verifier == verifiers.check(row["dataset"], row["ground_truth"]) and gt == row["ground_truth"]
        seen += b["prompt_index"].tolist()
    assert sorted(seen) == list(range(76))  # each prompt once per epoch
    assert seen != sorted(seen)  # shuffled


def test_ranks_split_the_global_batch_and_resume_is_exact_on_another_world_size(sources):
    train, more, _ = sources
    whole = loader(train, more, batch=8)
    steps = [whole.next_batch()["prompt_index"].tolist() for _ in range(25)]  # past an epoch (76 / 8 = 9.5 steps)
    two = [loader(train, more, world=2, rank=r, batch=8) for r in (0, 1)]
    for step in range(10):
        got = [L.next_batch() for L in two]
        assert got[0]["prompt_index"].tolist() + got[1]["prompt_index"].tolist() == steps[step]
    state = two[0].state_dict()
    four = [loader(train, more, world=4, rank=r, batch=8) for r in range(4)]
    for L in four:
        L.load_state_dict(json.loads(json.dumps(state)))
    for step in range(10, 25):
        assert sum((L.next_batch()["prompt_index"].tolist() for L in four), []) == steps[step]


def test_the_fingerprint_covers_the_ground_truths(sources, tmp_path):
    train, _, _ = sources
    copy = tmp_path / "copy" / "train"  # the same name: the same weight
    copy.mkdir(parents=True)
    for p in train.iterdir():
        if p.is_file():
            (copy / p.name).write_bytes(p.read_bytes())
    assert loader(copy).fingerprint == loader(train).fingerprint
    side = shards.prompts_path(copy, 0)
    side.write_bytes(side.read_bytes().replace(b'"ground_truth":"', b'"ground_truth":"1', 1))
    with pytest.raises(ValueError, match=r"shard-00000.prompts.jsonl: checksum differs.*prepare the data again"):
        loader(copy)
    meta = json.loads((copy / "shard-00000.json").read_text())
    meta["prompts_checksum"] = shards.sha256_file(side)  # a re-prepared sidecar: another fingerprint
    (copy / "shard-00000.json").write_text(json.dumps(meta))
    L = loader(copy)
    assert L.fingerprint != loader(train).fingerprint
    with pytest.raises(ValueError, match="refusing to resume on different data"):
        L.load_state_dict(loader(train).state_dict())


def test_validation_prompts_share_a_source_between_ranks(sources):
    train, _, _ = sources
    want = encoded(FIXTURES / "train.jsonl")
    shares = [validation_prompts(train, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [12, 12, 12]
    got = sorted((p for s in shares for p in s), key=lambda p: p.index)
    assert [p.index for p in got] == list(range(36))
    for p, (ids, row) in zip(got, want):
        assert p.ids == ids and p.ground_truth == row["ground_truth"] and p.verifier == verifiers.check(row["dataset"], row["ground_truth"])
        assert p.source == f"{FIXTURES / 'train.jsonl'}:{p.index + 1}"
    assert [len(validation_prompts(SourceConfig(path=str(train)), r, 5)) for r in range(5)] == [8, 7, 7, 7, 7]


def test_refusals_name_the_problem(sources, tmp_path):
    train, _, _ = sources
    chat = tmp_path / "chat"
    prepare(PrepareConfig(inputs=[str(FIXTURES / "sft.jsonl")], output=chat, tokenizer=str(DOLMA2), format="chat", chat_template="olmo3",
                          progress=False), log=lambda _: None)
    with pytest.raises(ValueError, match="RL prompts: GRPO.*in one mixture"):
        loader(train, chat)
    with pytest.raises(ValueError, match="not RL prompts"):
        validation_prompts(chat, 0, 1)
    with pytest.raises(ValueError, match="RL prompts have no tokens to score a loss on.*validation_prompts"):
        validation_batches(train, SEQ, 2, 0, 1)
    longest = max(len(ids) for ids, _ in encoded(FIXTURES / "train.jsonl"))
    cfg = DataConfig(sources=[SourceConfig(path=str(train))], prefetch=0)
    with pytest.raises(ValueError, match=rf"has {longest} tokens, no fewer than seq_len {longest}.*--max-tokens"):
        DataLoader(cfg, seq_len=longest, global_batch_size=4, dp_rank=0, dp_world_size=1)
    DataLoader(cfg, seq_len=longest + 1, global_batch_size=4, dp_rank=0, dp_world_size=1)


def test_prefetch_gives_the_same_batches(sources):
    train, more, _ = sources
    a = loader(train, more, batch=4)
    b = DataLoader(DataConfig(sources=[SourceConfig(path=str(train), weight=36), SourceConfig(path=str(more), weight=40)], prefetch=2, seed=3), seq_len=SEQ,
                   global_batch_size=4, dp_rank=0, dp_world_size=1)
    try:
        for _ in range(5):
            x, y = a.next_batch(), b.next_batch()
            assert x["prompt_ids"] == y["prompt_ids"] and torch.equal(x["prompt_index"], y["prompt_index"]) and x["ground_truth"] == y["ground_truth"]
    finally:
        b.close()


def test_active_samplings_extra_draws_are_keyed_by_step_and_draw_and_leave_the_order_alone(sources):
    """`prompt_draw(step, draw)`: a global batch of prompts, the same whatever the ranks (rank r's share is the r-th
    part) and on every call, another for another step or draw; the training order is untouched, and `give_back`
    hands the last batch out again."""
    train, more, _ = sources
    whole = loader(train, more, batch=8)
    plain = [whole.next_batch()["prompt_index"].tolist() for _ in range(3)]
    L = loader(train, more, batch=8)
    first = L.next_batch()["prompt_index"].tolist()
    extra = L.prompt_draw(0, 1)["prompt_index"].tolist()
    assert len(extra) == 8 and len(set(extra)) == 8 and extra == L.prompt_draw(0, 1)["prompt_index"].tolist()
    assert extra != L.prompt_draw(0, 2)["prompt_index"].tolist() and extra != L.prompt_draw(1, 1)["prompt_index"].tolist()
    two = [loader(train, more, world=2, rank=r, batch=8) for r in (0, 1)]
    assert sum((x.prompt_draw(0, 1)["prompt_index"].tolist() for x in two), []) == extra
    second = L.next_batch()["prompt_index"].tolist()
    L.give_back()
    assert [first, second, L.next_batch()["prompt_index"].tolist(), L.next_batch()["prompt_index"].tolist()] == \
           [plain[0], plain[1], plain[1], plain[2]]
