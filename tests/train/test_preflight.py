"""Every cross-check of a run fails before any heavy work (no process group, no model), naming both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from olmo_ds.model.config import preset
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.ds_config import ZeroLayout
from olmo_ds.train.plan import check_resume
from olmo_ds.train.trainer import Trainer

from train_testlib import ROOT, SHARED, tiny_config, write_markov_shards

NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"


@pytest.fixture(scope="module")
def neox_shards(tmp_path_factory):
    """Shards that claim the OLMo 1 tokenizer (its fingerprint and vocab), ids kept small."""
    tok = load_tokenizer(NEOX)
    return write_markov_shards(tmp_path_factory.mktemp("neox") / "shards", 5000, fingerprint=tok.fingerprint, vocab_size=tok.vocab_size)


@pytest.fixture
def one_rank(monkeypatch):
    """Environment of a launched rank (restored afterwards); world size 1 unless a test changes it."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def fails(cfg: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        Trainer.from_config(config_from_dict(cfg, source=str(tmp_path / "run.yaml")))
    assert not torch.distributed.is_initialized(), "the check ran after the process group was created"


def test_vocab_and_tokenizer_checks(tmp_path, neox_shards, one_rank):
    base = tiny_config(tmp_path, neox_shards, tokenizer=str(NEOX))
    fails({**base, "model": {**base["model"], "vocab_size": 50000}},
          rf"model vocab_size 50000 is smaller than tokenizer vocab 50280 \({NEOX}\)", tmp_path)
    fails({**base, "tokenizer": str(DOLMA2)},
          rf"tokenizer {DOLMA2}, content sha256:\w+, is not the tokenizer the data was prepared with: {neox_shards}/manifest.json records sha256:\w+", tmp_path)
    no_tok = {k: v for k, v in base.items() if k != "tokenizer"}
    fails({**no_tok, "model": {**base["model"], "vocab_size": 1000}},
          rf"model vocab_size 1000 is smaller than tokenizer vocab 50280 \({neox_shards}/manifest.json\)", tmp_path)
    fails({**base, "eval": {"every": 5, "tasks": ["no_such_task"]}}, r"eval.tasks: task 'no_such_task': no such path", tmp_path)


def test_shape_batch_and_deepspeed_checks(tmp_path, one_rank):
    data = write_markov_shards(tmp_path / "shards", 5000)
    base = tiny_config(tmp_path, data)
    fails({**base, "batch": {**base["batch"], "seq_len": 128}}, r"batch.seq_len 128 exceeds model.max_seq_len 64", tmp_path)
    ds = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    ds["gradient_clipping"] = 0.5
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    fails({**base, "deepspeed_config": str(tmp_path / "ds.json")},
          rf"{tmp_path}/ds.json: gradient_clipping = 0.5 contradicts optim.grad_clip = 1.0 in {tmp_path}/run.yaml", tmp_path)
    fails({**base, "eval": {"every": 5, "tasks": ["arc_easy_rc_0shot"]}}, r"eval.tasks needs `tokenizer` set", tmp_path)
    fails({**base, "eval": {"every": 5}}, r"eval.every is 5 but there is nothing to evaluate: no data source has a validation split "
                                          r"\(SOURCE/val/, which `prepare_data.py --val-fraction 0.01` writes\).*--set eval.every=0", tmp_path)
    fails({**base, "data": {"sources": [{"path": str(tmp_path / "missing")}]}}, rf"run.yaml: data: data source {tmp_path}/missing: no such directory", tmp_path)
    with pytest.raises(ConfigError, match=r"--resume .*nope: no such checkpoint directory"):
        Trainer.from_config(config_from_dict(base, source="run.yaml"), resume=str(tmp_path / "nope"))
    one_rank.setenv("WORLD_SIZE", "3")
    fails(base, r"global batch size 8 is not divisible by batch.micro_batch_size 2 x data-parallel size 3 = 6", tmp_path)


def test_resume_refuses_another_model_or_world_size(tmp_path):
    """Another world size resumes through a universal checkpoint, except across ZeRO stages or with offload."""
    model = preset("tiny", vocab_size=256)
    zero3 = {"zero_optimization": {"stage": 3}}
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    saved = {"model": preset("tiny", vocab_size=256, n_layers=3).to_dict(), "world_size": 2, "zero_stage": 3, "ds_config": zero3}
    with pytest.raises(ConfigError, match=r"n_layers: checkpoint 3, config 2"):
        check_resume(saved, model, 2, tmp_path, ZeroLayout.of(zero3))
    same_model = {**saved, "model": model.to_dict(), "world_size": 4}
    check_resume(same_model, model, 2, tmp_path, ZeroLayout.of(zero3))  # converted on load
    # Kernel choices are not the model: a run compiled on GPUs resumes eagerly, with checkpointing, etc.
    check_resume(same_model, preset("tiny", vocab_size=256, compile="eager", activation_checkpointing=True,
                                    attention_backend="sdpa_math"), 2, tmp_path, ZeroLayout.of(zero3))
    with pytest.raises(ConfigError, match=r"written by 4 data-parallel ranks, this run has 2 and ZeRO stage 2 \(the checkpoint's is 3\)"):
        check_resume(same_model, model, 2, tmp_path, ZeroLayout.of({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match=r"this run has 2; a CPU-offloaded ZeRO run resumes only on its checkpoint's number of ranks"):
        check_resume(same_model, model, 2, tmp_path, ZeroLayout.of(offload))
    with pytest.raises(ConfigError, match=r"CPU-offloaded ZeRO run"):
        check_resume({**same_model, "ds_config": offload}, model, 2, tmp_path, ZeroLayout.of(zero3))
    check_resume({**same_model, "world_size": 2, "ds_config": offload}, model, 2, tmp_path, ZeroLayout.of(offload))  # same size: as saved
