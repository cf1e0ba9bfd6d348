"""A run dir holds one run: a second start there is refused unless told to continue (--resume) or to start
over (--start-over, which moves the old run aside and deletes nothing); a refused start changes no file."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds.train.config import ConfigError
from olmo_ds.train.plan import claim_run_dir
from olmo_ds.train.run_lock import LOCK_FILE

from train_testlib import ROOT, launch_env, tiny_config, write_config, write_markov_shards


def tree(directory: Path) -> dict[str, str]:
    """Every file and its content but the run dir's lock (`olmo_ds.train.run_lock`), which each accepted start rewrites."""
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*")) if p.name != LOCK_FILE}


@pytest.mark.parametrize("marker", ["checkpoints/step-0000004", "metrics.jsonl", "wandb_id"])
def test_any_marker_makes_a_run_and_a_plain_start_is_refused(tmp_path, marker):
    run = tmp_path / "run"
    (run / marker).parent.mkdir(parents=True, exist_ok=True)
    (run / marker).mkdir() if marker.startswith("checkpoints") else (run / marker).write_text("x\n")
    before = tree(run)
    with pytest.raises(ConfigError, match=rf"already holds a run \({marker}\); continue it with --resume auto, or start a new run there with --start-over"):
        claim_run_dir(run, None, False, rank=0)
    assert tree(run) == before
    claim_run_dir(run, "auto", False, rank=0)  # continuing is fine
    assert tree(run) == before


def test_an_empty_or_unrelated_dir_is_not_a_run(tmp_path):
    (tmp_path / "run" / "tb").mkdir(parents=True)
    assert ckpt.run_markers(tmp_path / "run") == [] and ckpt.run_markers(tmp_path / "missing") == []
    claim_run_dir(tmp_path / "run", None, False, rank=0)


def test_start_over_moves_the_old_run_aside_whole(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree(run)
    claim_run_dir(run, None, True, rank=1)  # only rank 0 moves
    assert tree(run) == before
    claim_run_dir(run, None, True, rank=0)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert [p.name for p in run.iterdir()] == [LOCK_FILE] and len(aside) == 1 and tree(aside[0]) == before  # the new run's lock


def test_resume_of_another_runs_checkpoint_into_a_held_dir_is_refused(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other" / "checkpoints" / "step-0000004"
    (run / "checkpoints" / "step-0000008").mkdir(parents=True)
    other.mkdir(parents=True)
    with pytest.raises(ConfigError, match="a checkpoint of another run"):
        claim_run_dir(run, str(other), False, rank=0)
    claim_run_dir(run, str(run / "checkpoints" / "step-0000008"), False, rank=0)
    with pytest.raises(ConfigError, match="exclude each other"):
        claim_run_dir(run, "auto", True, rank=0)


def test_second_start_is_refused_then_start_over_begins_a_new_run(tmp_path):
    """Real single-rank launches: the refused start exits 2 within start-up and changes no byte of the first run."""
    cfg = tiny_config(tmp_path, write_markov_shards(tmp_path / "shards", 20_000), max_steps=4,
                      checkpoint={"every": 2}, logging={"tensorboard": False})
    config = write_config(tmp_path / "run.yaml", cfg)
    pretrain = [sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config)]
    first = subprocess.run(pretrain, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run = Path(cfg["run_dir"])
    before = tree(run)

    again = subprocess.run(pretrain, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--start-over" in again.stderr, again.stderr[-3000:]
    assert tree(run) == before

    fresh = subprocess.run([*pretrain, "--start-over"], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and tree(aside[0]) == before  # the first run, whole
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == len((aside[0] / "metrics.jsonl").read_text().splitlines())  # a new log, not appended to


def test_background_and_blocking_saves_write_the_same_checkpoints(tmp_path):
    """checkpoint.async_save always vs never: the same losses, and every saved checkpoint the same weights."""
    from olmo_ds.checkpoint import load_model_state

    data = write_markov_shards(tmp_path / "shards", 20_000)
    runs = {}
    for mode in ("never", "always"):
        cfg = tiny_config(tmp_path / mode, data, max_steps=6, checkpoint={"every": 2, "keep_last": 3, "async_save": mode},
                          logging={"every": 1, "tensorboard": False})
        (tmp_path / mode).mkdir()
        config = write_config(tmp_path / mode / "run.yaml", cfg)
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config)], env=launch_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and "training blocked" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
        runs[mode] = Path(cfg["run_dir"])
    assert (runs["never"] / "metrics.jsonl").read_text().count("train/loss") == 6
    losses = {m: [line.split('"train/loss": ')[1].split(",")[0] for line in (r / "metrics.jsonl").read_text().splitlines()] for m, r in runs.items()}
    assert losses["never"] == losses["always"]
    for step in ("step-0000002", "step-0000004", "step-0000006"):
        _, a, _ = load_model_state(runs["never"] / "checkpoints" / step)
        _, b, _ = load_model_state(runs["always"] / "checkpoints" / step)
        assert all(torch.equal(a[k], b[k]) for k in a), step
