"""One live run per run dir (issue 35, defect 3): a second start or resume beside a live run is refused at once,
naming the holder; the lock dies with its process, so a restart after a SIGKILL is never blocked. And a resumed
run logs every step once (defect 4): metrics.jsonl lines past the checkpoint are moved aside, TensorBoard purges them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from olmo_ds import checkpoint as ckpt
from olmo_ds.tools.check_resume import read_metrics
from olmo_ds.train.config import ConfigError
from olmo_ds.train.metrics import roll_back_metrics
from olmo_ds.train.plan import claim_run_dir
from olmo_ds.train.run_lock import LOCK_FILE, lock_run_dir

from train_testlib import ROOT, launch_env, tiny_config, write_config, write_markov_shards

HOLD = """
import os, sys, time
from olmo_ds.train.run_lock import lock_run_dir
lock_run_dir(sys.argv[1]).record()
child = os.fork()
if child == 0:  # a child forked after the lock (a data or compile worker) must not keep it
    time.sleep(600)
    os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(600)
"""


def test_a_held_run_dir_is_refused_naming_the_holder_and_freed_by_its_death(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=launch_env(), stdout=subprocess.PIPE, text=True)
    try:
        pid, child = map(int, holder.stdout.readline().split())
        for resume in ("auto", None):  # a resume and a plain start alike; the lock is checked before anything else
            with pytest.raises(ConfigError) as refused:
                claim_run_dir(run, resume, False, rank=0)
            assert (f"run_dir {run} is in use by a live run: pid {pid} on host {socket.gethostname()} since "
                    in str(refused.value)), refused.value
            assert f"holds {run / LOCK_FILE}" in str(refused.value)
        claim_run_dir(run, "auto", False, rank=1)  # only rank 0 claims: another rank of the same launch is not refused
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Its forked child lives on, but a record lock is the process's own: the dir is free at once.
    lock = claim_run_dir(run, "auto", False, rank=0)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    os.kill(child, signal.SIGKILL)


def test_roll_back_moves_the_lines_past_the_step_aside_and_keeps_a_clean_log(tmp_path):
    lines = [json.dumps({"step": s, "time": 1.0, "train/loss": 5.0 - s / 10}) + "\n" for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 11, "ti')  # the last line cut off by a kill
    aside, moved, steps = roll_back_metrics(tmp_path, 6)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:6])
    assert aside.name.startswith("metrics.jsonl.after-step-6-") and (moved, steps) == (5, "steps 7-10")
    assert aside.read_text() == "".join(lines[6:]) + '{"step": 11, "ti\n'  # nothing lost
    assert roll_back_metrics(tmp_path, 6) is None and roll_back_metrics(tmp_path / "none", 0) is None


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_markov_shards(tmp_path_factory.mktemp("run_lock") / "shards", 30_000)


def pretrain(config: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config), *args],
                            env=launch_env(), cwd=ROOT, text=True, **kw)


def tb_steps(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


@pytest.mark.slow  # three starts, ~50 s on 2 cores; the lock and the roll-back are tested on their own above
def test_second_start_beside_a_live_run_is_refused_and_a_restart_after_sigkill_logs_each_step_once(tmp_path, shards):
    """Real one-rank runs: the second start exits 2 within its start-up naming the first, which trains on untouched;
    after the first is SIGKILLed past its newest checkpoint, `--resume auto` starts, moves the lines logged past that
    checkpoint aside, and metrics.jsonl and TensorBoard end with every step once."""
    cfg = tiny_config(tmp_path, shards, max_steps=40, checkpoint={"every": 10, "keep_last": 2}, logging={"every": 1})
    config = write_config(tmp_path / "run.yaml", cfg)
    run_dir = Path(cfg["run_dir"])
    first = pretrain(config, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        second = pretrain(config, "--resume", "auto", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = second.communicate(timeout=180)
        assert second.returncode == 2, err[-3000:]
        assert f"run_dir {run_dir} is in use by a live run: pid {first.pid} on host {socket.gethostname()} since " in err, err[-3000:]
        assert first.poll() is None, "the first run stopped"
        # Past a checkpoint and a few steps more, then a SIGKILL: those steps are logged but not saved.
        while (not read_metrics(run_dir) or read_metrics(run_dir)[-1]["step"] < 24) and first.poll() is None:
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    newest = ckpt.list_checkpoints(ckpt.checkpoints_dir(run_dir))[-1][0]
    logged = [m["step"] for m in read_metrics(run_dir)]
    assert logged == list(range(1, len(logged) + 1)) and logged[-1] > newest, (logged, newest)

    restart = pretrain(config, "--resume", "auto", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = restart.communicate(timeout=300)
    assert restart.returncode == 0, out[-2000:] + err[-3000:]
    assert f"resumed from {ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(newest)} at step {newest}" in out
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 41))  # before: steps newest+1.. twice
    aside = list(run_dir.glob(f"metrics.jsonl.after-step-{newest}-*"))
    assert len(aside) == 1 and [json.loads(line)["step"] for line in aside[0].read_text().splitlines()] == logged[newest:]
    assert f"{len(logged) - newest} lines (steps {newest + 1}-{logged[-1]}) logged after step-{newest:07d}" in out
    losses = {m["step"]: m["train/loss"] for m in read_metrics(run_dir)}
    assert [s for s, _ in tb_steps(run_dir)] == list(range(1, 41))  # the dead run's steps past the checkpoint purged
    assert all(abs(v - losses[s]) < 1e-5 for s, v in tb_steps(run_dir))


def test_an_abandoned_start_leaves_the_run_dir_as_it_found_it(tmp_path):
    """A start that ends before training gives the run dir up: a dir it made with nothing but its lock is removed; one
    that holds anything else, or existed before, stays (lock file included) and is free for the next start."""
    made = lock_run_dir(tmp_path / "new")
    made.record()
    made.abandon()
    assert not (tmp_path / "new").exists()
    written = lock_run_dir(tmp_path / "written")
    (tmp_path / "written" / "reference").mkdir()  # e.g. a DPO reference cache the next start reuses
    written.abandon()
    assert sorted(p.name for p in (tmp_path / "written").iterdir()) == ["reference", LOCK_FILE]
    (tmp_path / "old").mkdir()
    earlier = lock_run_dir(tmp_path / "old")
    earlier.abandon()
    assert [p.name for p in (tmp_path / "old").iterdir()] == [LOCK_FILE]
    lock_run_dir(tmp_path / "old").release()  # free again in this process


@pytest.mark.slow  # a real start interrupted, ~20 s on 2 cores
def test_ctrl_c_while_the_engine_is_built_leaves_no_run_dir_behind(tmp_path, shards):
    """SIGINT to a real scripts/pretrain.py once its plan is made (its run dir locked), while DeepSpeed builds the engine:
    exit 130, the message, the run dir it made gone with its lock file, and no nanobind leak report on the way out."""
    cfg = tiny_config(tmp_path, shards, max_steps=40, logging={"every": 1, "tensorboard": False})
    run_dir = Path(cfg["run_dir"])
    proc = pretrain(write_config(tmp_path / "run.yaml", cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:  # the plan's last line before the trainer starts building the engine
            if "max_steps 40 reads" in line:
                break
        assert (run_dir / LOCK_FILE).is_file() and not (run_dir / "metrics.jsonl").exists()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "rank 0: interrupted before training started; nothing saved" in err, err[-3000:]
    assert "step 1/" not in out and not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    assert "leaked" not in err, err[-3000:]
