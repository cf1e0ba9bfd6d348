"""Sequence parallelism in the trainer (`parallel.sequence_parallel_size`, olmo_ds/train/parallel.py): real
Trainer steps on real DeepSpeed ZeRO-3 CPU ranks (gloo) with each row spread over 2 or 4 ranks give the steps of
whole rows: the same losses, gradients and token counts, for pretraining rows with document masks and for packed
fine-tuning rows with loss masks, on a tiny OLMo 3 whose sliding windows are smaller than a row; a checkpoint
saved at one size resumes at another with the same losses; and what cannot be spread is refused before any
process group exists. The model's side, and that the comparison sees the windows: tests/model/test_ulysses_attention.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from olmo_ds.train.config import ConfigError, load_config
from olmo_ds.train.parallel import ParallelLayout

from test_sft_multirank import VOCAB as SFT_VOCAB, rel, sft_source
from train_testlib import ROOT, losses_by_step, run, tiny_config, torchrun_cmd, write_config, write_markov_shards

WORKER = Path(__file__).with_name("sp_worker.py")
PRETRAIN = ROOT / "scripts" / "pretrain.py"
OLMO3 = {"preset": "tiny", "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden": 64,
         "sliding_window": 16, "sliding_window_pattern": [True, True, True, False], "max_seq_len": 64}


def pretraining_config(tmp_path, data, name, sp, **sections):
    """Document-masked rows of 64 tokens for the tiny OLMo 3 (windows of 16), `sp` ranks a row."""
    return tiny_config(tmp_path / name, data, **{
        "model": OLMO3, "parallel": {"sequence_parallel_size": sp},
        "data": {"sources": [{"path": str(data)}], "seed": 3, "prefetch": 1, "document_masking": True},
        "batch": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64},
        "logging": {"every": 1, "tensorboard": False}, **sections})


def steps(tmp_path, cfg: dict, name: str, *, nproc: int, n: int = 3) -> dict:
    path = write_config(tmp_path / f"{name}.yaml", cfg)
    out = tmp_path / f"{name}.pt"
    result = run(torchrun_cmd(WORKER, str(path), str(out), str(n), nproc=nproc))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return torch.load(out)


def assert_same_steps(got: dict, ref: dict) -> None:
    assert rel(got["grads"], ref["grads"]) < 1e-5, rel(got["grads"], ref["grads"])
    for a, b in zip(got["metrics"], ref["metrics"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a, b)
        for key in ("tokens", "global_batch_size", "trained_tokens", "packing_efficiency"):
            assert a.get(key) == b.get(key), (key, a, b)


@pytest.mark.multirank
def test_pretraining_rows_over_two_ranks_train_as_whole_rows(tmp_path):
    """With a batch-size schedule (4 rows, then 8 from step 2): the accumulation steps change mid-run."""
    data = write_markov_shards(tmp_path / "shards")
    runs = {}
    for sp in (1, 2):
        cfg = pretraining_config(tmp_path, data, f"sp{sp}", sp, checkpoint={"every": 0, "save_final": False},
                                 batch={"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64,
                                        "schedule": [{"step": 0, "global_batch_size": 4}, {"step": 2, "global_batch_size": 8}]})
        runs[sp] = steps(tmp_path, cfg, f"sp{sp}", nproc=2)
    assert runs[1]["layout"] == (2, 1) and runs[2]["layout"] == (1, 2)
    assert [m["tokens"] for m in runs[2]["metrics"]] == [4 * 64, 4 * 64, 8 * 64]  # each token counted once
    assert_same_steps(runs[2], runs[1])


@pytest.mark.slow
@pytest.mark.multirank
def test_four_ranks_train_alike_at_every_split_and_resume_at_another(tmp_path):
    """One test of the slow tier (the tier draws a share of its tests): both 4-rank checks below."""
    fine_tuning_at_every_split(tmp_path / "sft")
    checkpoint_resumes_at_another_size(tmp_path / "resume")


def fine_tuning_at_every_split(tmp_path):
    """4 ranks as 4 data-parallel, 2 x 2 and 1 x 4 sequence-parallel: the same steps of packed conversations."""
    tmp_path.mkdir()
    data = sft_source(tmp_path / "data")
    model = dict(OLMO3, sliding_window=128, max_seq_len=1024, vocab_size=SFT_VOCAB)
    runs = {}
    for sp in (1, 2, 4):
        cfg = tiny_config(tmp_path / f"sp{sp}", data, model=model, parallel={"sequence_parallel_size": sp},
                          batch={"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 1024},
                          optim={"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0, "z_loss": 1e-4},
                          checkpoint={"every": 0, "save_final": False}, logging={"every": 1, "tensorboard": False})
        runs[sp] = steps(tmp_path, cfg, f"sp{sp}", nproc=4, n=2)
    assert [runs[sp]["layout"] for sp in (1, 2, 4)] == [(4, 1), (2, 2), (1, 4)]
    assert runs[1]["metrics"][0]["trained_tokens"] > 0
    assert_same_steps(runs[2], runs[1])
    assert_same_steps(runs[4], runs[1])


def checkpoint_resumes_at_another_size(tmp_path):
    """Saved at 2 x 2 (data x sequence) on 4 ranks, resumed at 1 x 4 and at 4 x 1: the losses of the run that went on."""
    tmp_path.mkdir()
    data = write_markov_shards(tmp_path / "shards")
    cfg = pretraining_config(tmp_path, data, "run", 2, max_steps=4, checkpoint={"every": 2, "keep_last": 2})
    config = write_config(tmp_path / "run.yaml", cfg)
    straight = Path(cfg["run_dir"])
    result = run(torchrun_cmd(PRETRAIN, "--config", str(config), nproc=4))
    assert result.returncode == 0, result.stderr[-4000:]
    ref = losses_by_step(straight)
    assert sorted(ref) == [1, 2, 3, 4]
    for sp in (4, 1):
        resumed = tmp_path / f"resumed-sp{sp}"
        shutil.copytree(straight / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
        result = run(torchrun_cmd(PRETRAIN, "--config", str(config), "--set", f"run_dir={resumed}",
                                  "--set", f"parallel.sequence_parallel_size={sp}", "--resume", "auto", nproc=4))
        assert result.returncode == 0, result.stderr[-4000:]
        again = losses_by_step(resumed)
        assert sorted(again) == [3, 4], again
        for s in (3, 4):
            assert abs(again[s] - ref[s]) <= 1e-6 * ref[s], (sp, again, ref)


def test_what_cannot_be_spread_is_refused_before_start(tmp_path):
    data = write_markov_shards(tmp_path / "shards", num_tokens=5_000)

    def config(sp, **sections):
        cfg = pretraining_config(tmp_path, data, "bad", sp, **sections)
        return load_config(write_config(tmp_path / "bad.yaml", cfg))

    assert ParallelLayout.of(config(2), rank=3, world_size=4) == ParallelLayout(world_size=4, sp_size=2, rank=3)
    layout = ParallelLayout.of(config(2), rank=3, world_size=4)
    assert (layout.dp_size, layout.dp_rank, layout.sp_rank) == (2, 1, 1)
    with pytest.raises(ConfigError, match="sequence_parallel_size 2 does not divide the 3 ranks"):
        ParallelLayout.of(config(2), rank=0, world_size=3)
    with pytest.raises(ConfigError, match=r"bad.yaml: parallel.sequence_parallel_size 8: the model's 4 attention heads"):
        config(8)
    with pytest.raises(ConfigError, match="batch.seq_len 66 is not a multiple of 4"):
        config(4, batch={"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 66})
    with pytest.raises(ConfigError, match="must be a positive integer, got 0"):
        config(0)
