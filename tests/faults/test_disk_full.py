"""A full disk while writing shards and while saving a checkpoint (blocking or in the background): a clear error, nothing lost.

Two ways to fill a disk: a tiny tmpfs mounted over the output (a real ENOSPC; needs root and
mount, skipped where unavailable) and RLIMIT_FSIZE set in the child (EFBIG past a file size; works
anywhere). After the failure every shard or checkpoint that was complete before must be byte-for-byte
intact and loadable, and once space is back the rerun must finish with the uninterrupted output.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from olmo_ds.data import shards
from olmo_ds import checkpoint as ckpt
from tests.faults.faultlib import MODE, ROOT, Ranks, base_env, dir_bytes, record, write_c4_corpus
from tests.faults.test_prepare_kill import prepare_cmd
from tests.train.train_testlib import tiny_config, write_config, write_markov_shards

FAULT_SHARDS = "disk full while writing shards"
FAULT_CKPT = "disk full while saving a checkpoint"
DISK_FULL_WORDS = ("No space left on device", "File too large")


def file_size_limit(limit: int):
    """preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, so the write returns an error)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = Path(f"/tmp/olmo-ds-mount-probe-{uuid.uuid4().hex}")
    probe.mkdir()
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    finally:
        probe.rmdir()


@contextmanager
def tmpfs(path: Path, size: int):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def grow(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


MECHANISMS = ["rlimit", pytest.param("tmpfs", marks=[pytest.mark.skipif(MODE != "full", reason="make test-faults"),
                                                      pytest.mark.skipif(not can_mount(), reason="needs root and mount")])]


def complete_shards(directory: Path) -> dict[str, bytes]:
    """The files of every shard whose metadata exists (the writer's completion mark), by name."""
    out = {}
    for meta in sorted(directory.rglob("shard-*.json")):
        stem = meta.name[: -len(".json")]
        for p in sorted(meta.parent.glob(stem + ".*")):
            if not p.name.endswith(".tmp"):
                out[str(p.relative_to(directory))] = p.read_bytes()
    return out


def clear_error(stderr: str, out: Path) -> bool:
    """One line naming the problem and the file, not a traceback."""
    return any(w in stderr for w in DISK_FULL_WORDS) and str(out) in stderr and "Traceback" not in stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    work = tmp_path_factory.mktemp("disk_full")
    raw = write_c4_corpus(work / "raw", copies=6)
    # One document ~25 shards long in the middle: with a file-size limit only its shard overflows.
    big = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the fence."] * 4000)
    with open(raw / "part-000.jsonl", "a") as f:
        f.write('{"text": "%s"}\n' % big)
    ref = work / "ref"
    proc = subprocess.run(prepare_cmd(raw, ref), cwd=ROOT, env=base_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return work, raw, dir_bytes(ref)


# Whole files: the workers' pieces (a file's ids) fill the disk too, usually before any shard of
# that file is written, so there may be no complete shard to keep; the rest holds as in blocks.
@pytest.mark.parametrize("unit", ["blocks", "files"])
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_disk_full_while_writing_shards(corpus, mechanism, unit, tmp_path):
    work, raw, expected = corpus
    cmd = functools.partial(prepare_cmd, unit=unit)
    total = sum(len(v) for v in expected.values())
    largest = max(len(v) for v in expected.values())
    out = tmp_path / "out"
    with (tmpfs(out, total // 2) if mechanism == "tmpfs" else _nothing(out)):
        limit = file_size_limit(largest // 2) if mechanism == "rlimit" else None
        proc = subprocess.run(cmd(raw, out), cwd=ROOT, env=base_env(), capture_output=True, text=True, preexec_fn=limit)
        failed = proc.returncode != 0
        kept = complete_shards(out)
        intact = all(expected.get(k) == v for k, v in kept.items()) and (len(kept) > 0 or unit == "files")
        loadable = True
        for meta in out.rglob("shard-*.json"):
            m = shards.ShardMeta.load(meta)
            loadable &= len(shards.open_tokens(meta.with_name(m.bin), m)) == m.num_tokens
        if mechanism == "tmpfs":
            grow(out, total * 4)
            rerun = subprocess.run(cmd(raw, out), cwd=ROOT, env=base_env(), capture_output=True, text=True)
            identical = rerun.returncode == 0 and dir_bytes(out) == expected
    if mechanism == "rlimit":
        rerun = subprocess.run(cmd(raw, out), cwd=ROOT, env=base_env(), capture_output=True, text=True)
        identical = rerun.returncode == 0 and dir_bytes(out) == expected
    survived = failed and clear_error(proc.stderr, out) and intact and loadable and identical
    record(FAULT_SHARDS, survived=survived, data_lost=not (intact and loadable and identical))
    assert failed, "the run did not notice the full disk"
    assert clear_error(proc.stderr, out), proc.stderr[-3000:]
    assert intact and loadable, f"complete shards damaged: {sorted(kept)}"
    assert identical, rerun.stderr[-3000:]


@contextmanager
def _nothing(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    yield path


@pytest.mark.multirank
@pytest.mark.skipif(MODE != "full", reason="three 2-rank launches: make test-faults")
def test_disk_full_while_saving_a_checkpoint(tmp_path):
    """Resume from a complete step-3 checkpoint with too little room for the step-6 save."""
    data = write_markov_shards(tmp_path / "data")
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, data, run_dir=str(run_dir), max_steps=6, checkpoint={"every": 3, "keep_last": 2},
                      logging={"every": 1, "tensorboard": False})
    config = write_config(tmp_path / "run.yaml", cfg)
    first = Ranks(config, tmp_path / "logs-first", args=("--set", "max_steps=3"))
    assert first.wait(180) == [0, 0], first.tail()
    step3 = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(3)
    before = dir_bytes(step3)
    optim_file = max(len(v) for v in before.values())

    full = Ranks(config, tmp_path / "logs-full", preexec_fn=file_size_limit(optim_file // 2))
    codes = full.wait(180)
    log = full.log(0) + full.log(1)
    failed_losses = _losses(run_dir)
    intact = dir_bytes(step3) == before and (ckpt.checkpoints_dir(run_dir) / ckpt.LATEST).read_text().strip() == step3.name
    _, weights, state = ckpt.load_model_state(step3)
    loadable = state["step"] == 3 and len(weights) > 0
    # torch.save turns ENOSPC/EFBIG into a RuntimeError without errno: the trainer names the directory,
    # the previous checkpoint and the free space instead.
    clear = all(f"error: rank {r}: saving {run_dir / 'checkpoints' / ckpt.step_tag(6)} failed" in full.log(r) for r in (0, 1)) \
        and f"The previous checkpoint {step3} is intact" in log

    again = Ranks(config, tmp_path / "logs-again")
    resumed_ok = again.wait(180) == [0, 0]
    resumed = _losses(run_dir)
    exact = resumed_ok and all(resumed[s] == failed_losses[s] for s in (4, 5, 6)) and ckpt.is_complete(ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(6))
    record(FAULT_CKPT, survived=codes != [0, 0] and clear and intact and loadable and exact, data_lost=not (intact and loadable))
    assert codes != [0, 0], full.tail()
    assert clear, full.tail()
    assert intact and loadable
    assert exact, again.tail()


FAULT_ASYNC = "disk full during a background checkpoint write"


@pytest.mark.multirank
@pytest.mark.skipif(MODE != "full", reason="three 2-rank launches: make test-faults")
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_disk_full_during_a_background_write(tmp_path, mechanism):
    """`checkpoint.async_save: always`: the step-6 save's background write fails (RUN/checkpoints on a tmpfs
    with room for half a checkpoint more, or RLIMIT_FSIZE below the optimizer-state file) while training
    goes on; the failure is logged at once, raised on every rank at the step-9 save, and the step-3
    checkpoint stays `latest`, intact and loadable; with space back the run resumes exactly."""
    data = write_markov_shards(tmp_path / "data")
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, data, run_dir=str(run_dir), max_steps=9, checkpoint={"every": 3, "keep_last": 2, "async_save": "always"},
                      logging={"every": 1, "tensorboard": False})
    config = write_config(tmp_path / "run.yaml", cfg)
    root = ckpt.checkpoints_dir(run_dir)
    with (tmpfs(root, 256 * 2**20) if mechanism == "tmpfs" else _nothing(run_dir)):
        first = Ranks(config, tmp_path / "logs-first", args=("--set", "max_steps=3"))
        assert first.wait(180) == [0, 0], first.tail()
        step3 = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(3)
        before = dir_bytes(step3)
        size = sum(len(v) for v in before.values())
        optim_file = max(len(v) for v in before.values())
        if mechanism == "tmpfs":  # room for what is there and half a checkpoint more: the step-6 save runs out (ENOSPC)
            used = shutil.disk_usage(root).used
            grow(root, used + size // 2)
        full = Ranks(config, tmp_path / "logs-full", preexec_fn=file_size_limit(optim_file // 2) if mechanism == "rlimit" else None)
        codes = full.wait(180)
        log = full.log(0) + full.log(1)
        failed_losses = _losses(run_dir)
        step6 = run_dir / "checkpoints" / ckpt.step_tag(6)
        intact = dir_bytes(step3) == before and (ckpt.checkpoints_dir(run_dir) / ckpt.LATEST).read_text().strip() == step3.name \
            and not ckpt.is_complete(step6)
        _, weights, state = ckpt.load_model_state(step3)
        loadable = state["step"] == 3 and len(weights) > 0
        # Logged by the failing rank when its write fails, raised on every rank at the next save (step 9), after
        # training went on past step 6.
        noticed = f"writing {step6} failed in the background" in log and max(failed_losses) == 9
        clear = all(f"error: rank {r}: saving {step6} failed" in full.log(r) for r in (0, 1)) \
            and f"The previous checkpoint {step3} is intact" in log
        if mechanism == "tmpfs":
            grow(root, 4 * (used + size))
        again = Ranks(config, tmp_path / "logs-again")
        resumed_ok = again.wait(180) == [0, 0]
        resumed = _losses(run_dir)
        exact = resumed_ok and all(resumed[s] == failed_losses[s] for s in range(4, 10)) \
            and ckpt.is_complete(ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(9))
    record(FAULT_ASYNC, survived=codes != [0, 0] and noticed and clear and intact and loadable and exact,
           data_lost=not (intact and loadable))
    assert codes != [0, 0], full.tail()
    assert noticed and clear, full.tail()
    assert intact and loadable
    assert exact, again.tail()


def _losses(run_dir: Path) -> dict[int, float]:
    import json

    return {json.loads(line)["step"]: json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
