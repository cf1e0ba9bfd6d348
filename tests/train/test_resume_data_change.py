"""Resuming on different data is a one-line error naming the checkpoint (exit 2), not a traceback."""

from __future__ import annotations

import subprocess
import sys

from train_testlib import ROOT, launch_env, tiny_config, write_config, write_markov_shards


def pretrain(config, *args: str) -> subprocess.CompletedProcess:
    """One rank, no launcher: `python scripts/pretrain.py` reads the rendezvous from the environment."""
    env = {**launch_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_resume_on_other_data_names_the_checkpoint_and_exits_2(tmp_path):
    cfg = tiny_config(tmp_path, write_markov_shards(tmp_path / "a", 20_000, seed=0),
                      max_steps=2, checkpoint={"every": 2, "keep_last": 1}, logging={"every": 1, "tensorboard": False})
    first = pretrain(write_config(tmp_path / "a.yaml", cfg))
    assert first.returncode == 0, first.stderr[-3000:]

    cfg["data"] = {**cfg["data"], "sources": [{"path": str(write_markov_shards(tmp_path / "b", 20_000, seed=1))}]}
    cfg["max_steps"] = 4
    second = pretrain(write_config(tmp_path / "b.yaml", cfg), "--resume", "auto")
    assert second.returncode == 2, second.stderr[-3000:]
    assert "error: " in second.stderr and "step-0000002: refusing to resume on different data" in second.stderr
    assert "Traceback" not in second.stderr
