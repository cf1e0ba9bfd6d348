"""Hard kills and preemption of a real 2-rank ZeRO-3 run: nothing is lost, the resume is bitwise exact.

A chain is one run killed again and again: each launch (`--resume auto`) is SIGKILLed as a whole
(both ranks at once, a node losing power) either at a random step or a random moment just after a
checkpoint save has started; one launch per chain gets SIGTERM on every rank instead (what Slurm
sends on preemption) and must save and exit 0. Other launches save in the background
(`checkpoint.async_save: always`) and are SIGKILLed, or get SIGTERM, at a random moment while such a
save is in flight (training has gone on past the saved step): the killed save must never become
`latest` nor be picked by evaluation or export, and the preempted run must let it complete before
its own save. After each fault the next launch must resume from the newest checkpoint that was
complete on disk, and every loss, gradient norm and learning rate it logs must equal the
uninterrupted run's (blocking saves) to the last bit; the chain's final weights must equal the
uninterrupted run's exactly.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from olmo_ds import checkpoint as ckpt
from tests.faults.faultlib import MODE, ROOT, Ranks, base_env, check, record, rng, trials, wait_for
from tests.train.train_testlib import tiny_config, write_config, write_markov_shards

FAULT_STEP = "SIGKILL 2-rank training at a random step"
FAULT_SAVE = "SIGKILL 2-rank training during a checkpoint save"
FAULT_TERM = "SIGTERM every rank (preemption)"
FAULT_ASYNC = "SIGKILL 2-rank training during a background save"
FAULT_ASYNC_TERM = "SIGTERM every rank during a background save"
ASYNC_KINDS = ("async", "async_term")
BACKGROUND = ("--set", "checkpoint.async_save=always")
MAX_STEPS = 24
EVERY = 3
LAUNCH_TIMEOUT = 180
COMPARED = ("train/loss", "train/z_loss", "train/grad_norm", "train/lr", "train/tokens_seen")

pytestmark = pytest.mark.multirank


def config(tmp: Path, data: Path, run_dir: Path) -> Path:
    cfg = tiny_config(tmp, data, run_dir=str(run_dir), max_steps=MAX_STEPS,
                      checkpoint={"every": EVERY, "keep_last": 2}, logging={"every": 1, "tensorboard": False})
    return write_config(tmp / f"{run_dir.name}.yaml", cfg)


def metrics_lines(run_dir: Path, since: float = 0.0) -> list[dict]:
    """metrics.jsonl's whole lines logged at or after the time `since` (a launch's start: its own lines; a resumed
    launch first moves the lines past its checkpoint aside, so counting lines would not tell launches apart)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    # The trainer may be in the middle of writing a line: only newline-terminated lines are whole.
    return [m for m in map(json.loads, text[: text.rfind("\n") + 1].splitlines()) if m["time"] >= since]


def last_step(run_dir: Path, since: float) -> int:
    """The step of the last metrics line the launch started at `since` logged (0 before its first)."""
    lines = metrics_lines(run_dir, since)
    return lines[-1]["step"] if lines else 0


def newest_complete(run_dir: Path) -> tuple[int, Path | None]:
    found = ckpt.list_checkpoints(ckpt.checkpoints_dir(run_dir))
    return found[-1] if found else (0, None)


def resumed_from(log: str) -> tuple[str, int] | None:
    m = re.search(r"resumed from (\S+) at step (\d+)", log)
    return (m.group(1), int(m.group(2))) if m else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_kill")
    data = write_markov_shards(tmp / "data")
    run_dir = tmp / "reference"
    ranks = Ranks(config(tmp, data, run_dir), tmp / "logs-reference", args=())
    codes = ranks.wait(LAUNCH_TIMEOUT)
    assert codes == [0, 0], ranks.tail()
    by_step = {m["step"]: m for m in metrics_lines(run_dir)}
    assert sorted(by_step) == list(range(1, MAX_STEPS + 1))
    _, weights, _ = ckpt.load_model_state(ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(MAX_STEPS))
    return tmp, data, by_step, weights


def mismatches(lines: list[dict], expected: dict[int, dict]) -> list[str]:
    bad = []
    for m in lines:
        ref = expected[m["step"]]
        diff = [k for k in COMPARED if m[k] != ref[k]]
        if diff:
            bad.append(f"step {m['step']}: " + ", ".join(f"{k} {m[k]!r} != {ref[k]!r}" for k in diff))
    return bad


def plan(chain: int, draw) -> list[str]:
    kills = ["save" if draw.random() < 0.5 else "step" for _ in range(trials("train_kills_per_chain"))]
    kills += ["async"] * trials("train_async_kills_per_chain")
    draw.shuffle(kills)
    for kind, name in (("term", "train_sigterm"), ("async_term", "train_async_sigterm")):
        if chain < trials(name):
            kills.insert(draw.randrange(len(kills) + 1), kind)
    return kills


def previous_stays_latest(run_dir: Path, newest_dir: Path | None) -> bool:
    """After a background save was killed: `latest`, evaluation and export still name the checkpoint
    complete before it (none of them exist when there was none)."""
    from olmo_ds.weights import resolve_weights

    latest = ckpt.checkpoints_dir(run_dir) / ckpt.LATEST
    if newest_dir is None:
        return not latest.exists() and ckpt.latest_checkpoint(ckpt.checkpoints_dir(run_dir)) is None
    return latest.read_text().strip() == newest_dir.name and resolve_weights(run_dir) == ("checkpoint", newest_dir)


def saved_lines(log: str) -> list[str]:
    """The checkpoint tags rank 0 logged as complete, in order."""
    return re.findall(r"saved \S*/(step-\d+): training blocked", log)


def inject(kind: str, ranks: Ranks, run_dir: Path, newest: int, draw, since: float) -> dict:
    """Run one fault against a fresh launch (started at the time `since`); returns what happened."""
    procs = ranks.procs
    if kind in ASYNC_KINDS:
        return inject_in_flight(kind, ranks, run_dir, newest, draw, since)
    if kind == "save":
        # The step's metrics line is written just before its save starts: kill a few ms after it.
        next_save = (newest // EVERY + 1) * EVERY
        assert wait_for(lambda: last_step(run_dir, since) >= next_save, LAUNCH_TIMEOUT, poll=0.0005, procs=procs), ranks.tail()
        time.sleep(draw.uniform(0.0, 0.03))
        ranks.kill()
        ranks.wait(30)
        saving = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(next_save)
        mid_save = saving.is_dir() and not ckpt.is_complete(saving)
        return {"fault": FAULT_SAVE if mid_save else FAULT_STEP}
    target = draw.randint(newest + 1, MAX_STEPS - 2)
    assert wait_for(lambda: last_step(run_dir, since) >= target, LAUNCH_TIMEOUT, poll=0.005, procs=procs), ranks.tail()
    time.sleep(draw.uniform(0.0, 0.2))  # anywhere inside the next step, or its save
    if kind == "step":
        ranks.kill()
        ranks.wait(30)
        return {"fault": FAULT_STEP}
    ranks.signal_each(signal.SIGTERM)
    codes = ranks.wait(90)
    m = re.search(r"SIGTERM received: saving a checkpoint at step (\d+)", ranks.log(0))
    saved = int(m.group(1)) if m else None
    ok = codes == [0, 0] and saved is not None and newest_complete(run_dir)[0] == saved
    return {"fault": FAULT_TERM, "ok": ok, "detail": f"exit codes {codes}, saved step {saved}, newest {newest_complete(run_dir)}"}


def inject_in_flight(kind: str, ranks: Ranks, run_dir: Path, newest: int, draw, since: float) -> dict:
    """SIGKILL or SIGTERM while the launch's first background save is in flight: once training has logged
    the step after the saved one (rank 0 completes the save at its next poll, up to a second later)."""
    next_save = (newest // EVERY + 1) * EVERY
    saving = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(next_save)
    _, newest_dir = newest_complete(run_dir)
    assert wait_for(lambda: last_step(run_dir, since) >= next_save + 1, LAUNCH_TIMEOUT, poll=0.001, procs=ranks.procs), ranks.tail()
    if kind == "async":
        time.sleep(draw.uniform(0.0, 0.25))
        ranks.kill()
        ranks.wait(30)
        if not (saving.is_dir() and not ckpt.is_complete(saving)):
            return {"fault": FAULT_STEP}  # it completed first: a kill at a step like any other
        kept = previous_stays_latest(run_dir, newest_dir)
        return {"fault": FAULT_ASYNC, "ok": kept, "detail": f"killed with {saving.name} in flight; previous {newest_dir} "
                f"{'still' if kept else 'NOT'} latest and the one evaluation/export picks"}
    time.sleep(draw.uniform(0.0, 0.1))  # the ranks see the signal at the next step's start: before the next periodic save
    ranks.signal_each(signal.SIGTERM)
    codes = ranks.wait(90)
    log = ranks.log(0)
    m = re.search(r"SIGTERM received: saving a checkpoint at step (\d+) and exiting(; the background save of (step-\d+) completes first)?", log)
    saved, waited_for = (int(m.group(1)), m.group(3)) if m else (None, None)
    order = saved_lines(log)
    # A save in flight at the signal completes (and is logged) before the preemption's own save does.
    ok = codes == [0, 0] and saved is not None and order[-1:] == [ckpt.step_tag(saved)] and ckpt.is_complete(saving) \
        and (waited_for is None or waited_for == ckpt.step_tag(saved) or waited_for in order[:-1]) \
        and newest_complete(run_dir)[0] == saved and (ckpt.checkpoints_dir(run_dir) / ckpt.LATEST).read_text().strip() == ckpt.step_tag(saved)
    return {"fault": FAULT_ASYNC_TERM if waited_for else FAULT_TERM, "ok": ok,
            "detail": f"exit codes {codes}, saved step {saved} after waiting for {waited_for}, completed in order {order}, "
                      f"newest {newest_complete(run_dir)}"}


@pytest.mark.parametrize("chain", range(trials("train_kill_chains")))
def test_kills_and_preemption_resume_bitwise_exact(reference, chain):
    tmp, data, expected, ref_weights = reference
    draw = rng(f"train_kill:{chain}")
    kinds = plan(chain, draw)
    failures = []
    segment = 0
    while kinds or segment == 0:
        # A run whose newest checkpoint is too close to the end has no room for another kill: finish it
        # and go on with the remaining faults in a fresh run.
        failures += run_segment(tmp / f"chain{chain}-{segment}", data, kinds, draw, expected, ref_weights)
        segment += 1
    assert not failures, "\n\n".join(failures)


def run_segment(run_dir: Path, data: Path, kinds: list[str], draw, expected: dict, ref_weights: dict) -> list[str]:
    """Inject faults from `kinds` (consumed) into one run until it has no room left, then finish it and compare."""
    tmp = run_dir.parent
    cfg = config(tmp, data, run_dir)
    failures = []
    pending = None  # the fault whose survival the next launch decides
    launch = 0
    while True:
        newest, newest_dir = newest_complete(run_dir)
        kind = kinds.pop(0) if kinds and newest < MAX_STEPS - EVERY else "finish"
        started = time.time() - 0.01  # the metrics lines' times are rounded to ms
        ranks = Ranks(cfg, tmp / f"logs-{run_dir.name}-{launch}", args=("--resume", "auto", *(BACKGROUND if kind in ASYNC_KINDS else ())))
        if kind == "finish":
            codes = ranks.wait(LAUNCH_TIMEOUT)
            if codes != [0, 0]:
                failures.append(f"final launch: exit codes {codes}\n{ranks.tail()}")
        else:
            outcome = inject(kind, ranks, run_dir, newest, draw, started)
        resumed = resumed_from(ranks.log(0))
        expected_resume = (str(newest_dir), newest) if newest_dir else None
        bad = mismatches(metrics_lines(run_dir, started), expected)
        ok = resumed == expected_resume and not bad
        if pending is not None:
            record(pending["fault"], survived=ok and pending.get("ok", True), data_lost=resumed != expected_resume)
        if not ok or (pending is not None and not pending.get("ok", True)):
            failures.append(f"{run_dir.name} launch {launch} after {pending}: resumed {resumed}, expected {expected_resume}; "
                            f"{bad[:3]}\n{ranks.tail()}")
        if kind == "finish":
            break
        pending = outcome
        launch += 1

    steps = [m["step"] for m in metrics_lines(run_dir)]
    if steps != list(range(1, MAX_STEPS + 1)):  # each step once: lines past a resumed checkpoint were moved aside
        failures.append(f"{run_dir.name}: steps logged {steps}")
    final = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(MAX_STEPS)
    if ckpt.is_complete(final):
        _, weights, _ = ckpt.load_model_state(final)
        differ = [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])]
        if differ:
            failures.append(f"{run_dir.name}: final weights differ from the uninterrupted run's: {differ}")
    else:
        failures.append(f"{final} is not complete")
    return failures


@pytest.mark.skipif(MODE != "full", reason="one more launch: make test-faults")
def test_resume_from_a_checkpoint_of_another_model_shape(reference, tmp_path):
    """A real checkpoint, a config with another d_model: refused before any weight is touched."""
    tmp, _, _, _ = reference
    source = ckpt.checkpoints_dir(tmp / "reference") / ckpt.step_tag(MAX_STEPS)
    run_dir = tmp_path / "other"

    def resume():
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(tmp / "reference.yaml"),
                               "--set", "model.d_model=64", "--set", f"run_dir={run_dir}", "--resume", str(source)],
                              cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=180)
        if proc.returncode != 2:
            raise AssertionError(f"exit code {proc.returncode}\n{proc.stderr[-3000:]}")
        raise ValueError(proc.stderr)

    check("bad input: checkpoint of another model shape", resume,
          rf"{source}: the checkpoint's model differs from the configured one \(d_model: checkpoint 32, config 64", untouched=source.parent)
    assert not (run_dir / "checkpoints").exists(), "the refused run wrote checkpoints"


def test_latest_pointing_at_a_missing_step(reference, tmp_path):
    """`latest` is a convenience: resume and eval pick the newest complete checkpoint by scanning."""
    from olmo_ds.weights import resolve_weights

    tmp, _, _, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt.checkpoints_dir(tmp / "reference"), ckpt.checkpoints_dir(run_dir))
    (ckpt.checkpoints_dir(run_dir) / ckpt.LATEST).write_text("step-0000999\n")
    newest = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(MAX_STEPS)
    picked = (ckpt.resolve_resume("auto", run_dir), resolve_weights(run_dir)[1])
    record("bad input: `latest` names a missing step", survived=picked == (newest, newest))
    assert picked == (newest, newest)
    missing = str(ckpt.checkpoints_dir(run_dir) / "step-0000999")
    check("bad input: `latest` names a missing step", lambda: ckpt.resolve_resume(missing, run_dir),
          rf"--resume {missing}: no such checkpoint directory", untouched=ckpt.checkpoints_dir(run_dir))
