"""SIGKILL of scripts/prepare_data.py at random moments: every rerun completes, byte-identical.

The kill hits the whole process group (the script and its tokenizer workers) at a moment drawn
uniformly over an uninterrupted run's duration, so it lands in tokenizer loading, mid-shard,
between a shard's files, or while the manifest is written. Half of the trials also kill the first
rerun, so resuming from a resumed run is exercised too.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.faults.faultlib import NEOX, ROOT, base_env, dir_bytes, kill_group, record, rng, trials, write_c4_corpus

FAULT = "SIGKILL prepare_data.py at a random moment"


def prepare_cmd(raw, out) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(raw), "--output", str(out),
            "--tokenizer", str(NEOX), "--shard-tokens", "3000", "--workers", "2", "--val-fraction", "0.1", "--no-progress"]


def start(raw, out) -> subprocess.Popen:
    return subprocess.Popen(prepare_cmd(raw, out), cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def killed_at(raw, out, delay: float) -> bool:
    """Start a run and SIGKILL it after `delay` seconds; True if it was still running then."""
    proc = start(raw, out)
    try:
        proc.wait(delay)
        return False
    except subprocess.TimeoutExpired:
        kill_group(proc, signal.SIGKILL)
        proc.wait()
        return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("prepare_kill")
    raw = write_c4_corpus(work / "raw", copies=12)
    ref = work / "ref"
    t0 = time.monotonic()
    proc = subprocess.run(prepare_cmd(raw, ref), cwd=ROOT, env=base_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return raw, dir_bytes(ref), time.monotonic() - t0


def test_rerun_after_sigkill_at_a_random_moment_is_byte_identical(reference, tmp_path):
    raw, expected, duration = reference
    draw = rng("prepare_sigkill")
    failures = []
    for trial in range(trials("prepare_sigkill")):
        out = tmp_path / f"trial{trial}"
        delay = draw.uniform(0.05, duration)
        interrupted = killed_at(raw, out, delay)
        if trial % 2 == 1 and interrupted:
            killed_at(raw, out, draw.uniform(0.05, duration))  # kill the resumed run as well
        rerun = subprocess.run(prepare_cmd(raw, out), cwd=ROOT, env=base_env(), capture_output=True, text=True)
        identical = rerun.returncode == 0 and dir_bytes(out) == expected
        record(FAULT, survived=identical, data_lost=not identical)
        if not identical:
            failures.append(f"trial {trial} (kill after {delay:.2f}s): rc {rerun.returncode}\n{rerun.stderr[-2000:]}")
    assert not failures, "\n".join(failures)
