"""OLMo 3's three stages as a chain, on CPU: the shipped OLMo-3-style 1B stage configs, shrunk by one rule that
keeps what makes them stages (each length / 128, tiny dimensions, 2 steps), each stage starting from the
previous stage's last checkpoint: stage 2 with a new four-source mixture and the LR decayed linearly to 0,
stage 3 at 4x the context with YaRN over the trained length, document masking and stage 2's optimizer state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import load_config

from testdata import SHARED, pythonpath
from train_testlib import ROOT, launch_env, write_markov_shards

SCALE = 128  # 8192 -> 64, 65536 -> 512, window 4096 -> 32


def shrink(stage: int, data_dirs: dict[str, str]) -> list[str]:
    """--set overrides that turn configs/olmo3-style-1b-stageN.yaml into a CPU toy of the same shape."""
    cfg = load_config(ROOT / "configs" / f"olmo3-style-1b-stage{stage}.yaml")
    built = cfg.model.build(100278)
    sets = ["max_steps=2", "precision=fp32", "eval.every=0", "logging.every=1", "logging.tensorboard=false", "checkpoint.every=0",
            "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4", "model.mlp_hidden=128",
            f"model.max_seq_len={built.max_seq_len // SCALE}", f"model.sliding_window={built.sliding_window // SCALE}",
            f"batch.seq_len={cfg.batch.seq_len // SCALE}", "batch.global_batch_size=4"]
    if cfg.batch.micro_batch_size != "auto":  # the shipped configs choose it from memory: on CPU, all 4 rows at once
        sets.append(f"batch.micro_batch_size={min(cfg.batch.micro_batch_size, 4)}")
    if built.yarn is not None:
        sets.append("model.yarn.original_max_position_embeddings=" + str(built.yarn.original_max_position_embeddings // SCALE))
    sources = [{"path": data_dirs[s.name or "main"], "weight": s.weight, "name": s.name} for s in cfg.data.sources]
    sets.append("data.sources=" + json.dumps(sources))
    return sets


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> dict[str, str]:
    tok = load_tokenizer(SHARED / "tokenizers" / "dolma2-tokenizer.json")
    root = tmp_path_factory.mktemp("stages")
    return {name: str(write_markov_shards(root / name, 30_000, seed=i, fingerprint=tok.fingerprint, vocab_size=tok.vocab_size))
            for i, name in enumerate(["main", "web", "math", "code", "qa"])}


def test_three_stage_chain(tmp_path, data_dirs, hf_cache):
    env = {**launch_env(), "PYTHONPATH": pythonpath(ROOT)}
    states = []
    for stage in (1, 2, 3):
        cmd = [sys.executable, "-m", "olmo_ds.cli.pretrain", "--config", str(ROOT / "configs" / f"olmo3-style-1b-stage{stage}.yaml")]
        for s in shrink(stage, data_dirs):
            cmd += ["--set", s]
        result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"stage {stage}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        run = tmp_path / "runs" / f"olmo3-style-1b-stage{stage}"
        states.append(json.loads((run / "checkpoints" / "step-0000002" / "train_state.json").read_text()))
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
        if stage == 2:
            assert metrics[-1]["train/lr"] == 0.0  # decayed linearly to 0 by the last step
    one, two, three = states
    assert one["init_from"] is None
    assert two["init_from"]["directory"] == str(tmp_path / "runs" / "olmo3-style-1b-stage1" / "checkpoints" / "step-0000002")
    assert two["init_from"]["load_optimizer"] is False and two["data"]["step"] == 2
    assert [s["name"] for s in two["config"]["data"]["sources"]] == ["web", "math", "code", "qa"]
    assert three["init_from"]["directory"] == str(tmp_path / "runs" / "olmo3-style-1b-stage2" / "checkpoints" / "step-0000002")
    assert three["init_from"]["load_optimizer"] is True
    assert three["model"]["max_seq_len"] == 512 and three["model"]["yarn"]["factor"] == 8.0 and two["model"]["yarn"] is None
    assert three["config"]["data"]["document_masking"] is True and three["model"]["sliding_window"] == 32
    # The shipped configs' `micro_batch_size: auto`: each stage, not a resume, chose its own (4 rows fit a CPU).
    assert [(s["micro_batch"]["size"], s["micro_batch"]["chosen_by"]) for s in states] == [(4, "auto")] * 3
