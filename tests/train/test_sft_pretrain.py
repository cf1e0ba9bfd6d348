"""scripts/pretrain.py on a masked shard directory (real chat-sample conversations, OLMo 3 template, dolma2
tokenizer ids folded into a tiny model's vocabulary): a few steps on one CPU rank, logging the trained tokens,
the packing efficiency and the masked validation loss; an unmasked run's metrics carry none of them."""

from __future__ import annotations

import json
import shutil

import pytest

from sft_testlib import SmallVocab, encoded, folded, write_masked_source
from train_testlib import ROOT, read_metrics, run, tiny_config, torchrun_cmd, write_config

PRETRAIN = ROOT / "scripts" / "pretrain.py"
VOCAB = 512


def test_pretrain_on_masked_shards_logs_trained_tokens_packing_and_masked_val_loss(tmp_path):
    tok = SmallVocab(VOCAB, eos_id=VOCAB - 2, pad_id=VOCAB - 1)
    data = write_masked_source(tmp_path / "chat", folded(list(encoded("train")), VOCAB, {100257: VOCAB - 2}), tok=tok, shard_docs=100)
    write_masked_source(data / "val", folded(list(encoded("val")), VOCAB, {100257: VOCAB - 2}), tok=tok, split="val")
    cfg = tiny_config(tmp_path, data, max_steps=3,
                      model={"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64,
                             "max_seq_len": 512, "vocab_size": VOCAB},
                      batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 512},
                      data={"sources": [{"path": str(data)}], "long_conversations": "drop", "prefetch": 1},
                      eval={"every": 3, "max_batches": 2},
                      checkpoint={"every": 0, "save_final": True}, logging={"every": 1, "tensorboard": True})
    result = run(torchrun_cmd(PRETRAIN, "--config", str(write_config(tmp_path / "sft.yaml", cfg)), nproc=1))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    log = result.stdout + result.stderr
    assert "conversations packed into" in log and "dropped (data.long_conversations drop)" in log
    assert "trained " in log and "packing " in log  # the console line
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 0 < r["train/trained_tokens"] < 4 * 512
        assert 0.5 < r["data/packing_efficiency"] <= 1.0
        assert 0 < r["data/trained_fraction"] < r["data/packing_efficiency"]
    assert steps[-1]["train/trained_tokens_seen"] == sum(r["train/trained_tokens"] for r in steps)
    evals = [r for r in rows if "eval/chat/loss" in r]
    assert evals and 0 < evals[0]["eval/chat/loss"] < 10
    state = json.loads(next((tmp_path / "run").rglob("train_state.json")).read_text())
    assert state["trained_tokens_seen"] == steps[-1]["train/trained_tokens_seen"]


@pytest.mark.slow
def test_a_fine_tuning_run_resumed_from_its_checkpoint_continues_exactly(tmp_path):
    """Packed masked rows resume like pretraining data: from step 2's checkpoint, steps 3-4 give the uninterrupted
    run's losses and trained-token counts bit for bit, and the running total of trained tokens carries over."""
    tok = SmallVocab(VOCAB, eos_id=VOCAB - 2, pad_id=VOCAB - 1)
    data = write_masked_source(tmp_path / "chat", folded(list(encoded("train")), VOCAB, {100257: VOCAB - 2}), tok=tok, shard_docs=100)
    cfg = tiny_config(tmp_path, data, max_steps=4,
                      model={"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64,
                             "max_seq_len": 512, "vocab_size": VOCAB},
                      batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 512},
                      data={"sources": [{"path": str(data)}], "prefetch": 1},
                      checkpoint={"every": 2, "keep_last": 2}, logging={"every": 1, "tensorboard": False})
    straight = tmp_path / "run"
    result = run(torchrun_cmd(PRETRAIN, "--config", str(write_config(tmp_path / "sft.yaml", cfg)), nproc=1))
    assert result.returncode == 0, result.stderr[-6000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    again = run(torchrun_cmd(PRETRAIN, "--config", str(write_config(tmp_path / "resumed.yaml", {**cfg, "run_dir": str(resumed)})),
                             "--resume", "auto", nproc=1))
    assert again.returncode == 0, again.stderr[-6000:]
    ref = {r["step"]: r for r in read_metrics(straight) if "train/loss" in r}
    got = {r["step"]: r for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in ("train/loss", "train/trained_tokens", "train/trained_tokens_seen", "data/packing_efficiency"):
            assert got[step][key] == ref[step][key], (step, key, got[step][key], ref[step][key])
