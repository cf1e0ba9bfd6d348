"""The shipped configs run from a clone: the 1B config's first step on CPU, from any directory, with the
tokenizer named by hub id and read from an offline HF cache, the DeepSpeed config from the package, and
data prepared there from generated text with a validation split — nothing from ../shared but the file
that `hf download` would have put into the cache."""

from __future__ import annotations

import subprocess
import sys

import yaml

from testdata import pythonpath
from train_testlib import ROOT, launch_env

SHRINK = ["max_steps=1", "precision=fp32", "batch.global_batch_size=2", "batch.micro_batch_size=2", "batch.seq_len=64",
          "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.mlp_hidden=128",
          "model.max_seq_len=64", "eval.max_batches=1", "logging.every=1"]


def test_shipped_configs_name_no_local_test_data():
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        assert "../shared" not in config.read_text(), config


def test_olmo2_1b_config_first_step_from_a_clean_directory(tmp_path, hf_cache):
    env = {**launch_env(), "PYTHONPATH": pythonpath(ROOT)}
    corpus = tmp_path / "corpus"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_sample_corpus.py"), "--output", str(corpus), "--max-bytes", "300000"],
                   env=env, check=True, capture_output=True)
    prep = subprocess.run([sys.executable, "-m", "olmo_ds.cli.prepare_data", "--input", str(corpus), "--output", "data/dolma/shards",
                           "--tokenizer", "allenai/dolma2-tokenizer", "--val-fraction", "0.05", "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    overrides = [a for s in SHRINK for a in ("--set", s)]
    run = subprocess.run([sys.executable, "-m", "olmo_ds.cli.pretrain", "--config", str(ROOT / "configs" / "olmo2-1b.yaml"), *overrides],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    log = run.stdout + run.stderr
    assert "step 1/1" in log and "eval step 1" in log, log[-3000:]
    ckpt = tmp_path / "runs" / "olmo2-1b" / "checkpoints" / "step-0000001"
    state = yaml.safe_load((ckpt / "train_state.json").read_text())
    assert state["config"]["tokenizer"] == "allenai/dolma2-tokenizer"
    assert (ckpt / "tokenizer.json").read_bytes() == (hf_cache / "models--allenai--dolma2-tokenizer" / "snapshots" / ("0" * 40) / "tokenizer.json").read_bytes()
