"""SIGKILL of scripts/prepare_data.py at random moments: every rerun completes, byte-identical.

The kill hits the whole process group (the script and its tokenizer workers) at a moment drawn
uniformly over an uninterrupted run's duration, so it lands in tokenizer loading, mid-shard,
between a shard's files, or while the manifest is written. Half of the trials also kill the first
rerun, so resuming from a resumed run is exercised too. Both work units run: blocks handed out by
the main process, and whole files (workers write pieces and finish shards out of order), each
compared with the same reference (a blocks run; an uninterrupted whole-file run must equal it too). The partitioned case runs M = 3 parts as
Slurm array tasks (scripts/slurm/prepare_array.sbatch with a stand-in `srun`), kills one, checks
that the merge refuses the unfinished part, resumes it, and merges to a single run's tokens.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from olmo_ds.data.dataset import TokenSource
from olmo_ds.data.prepare.partition import MergeError, merge_parts
from tests.data.test_partition import array_task, fake_srun
from tests.faults.faultlib import NEOX, ROOT, base_env, dir_bytes, kill_group, record, rng, trials, write_c4_corpus

FAULT = "SIGKILL prepare_data.py at a random moment"


ARGS = ["--tokenizer", str(NEOX), "--shard-tokens", "3000", "--val-fraction", "0.1", "--no-progress"]


def prepare_cmd(raw, out, unit: str = "blocks") -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(raw), "--output", str(out), "--workers", "2",
            "--work-unit", unit, *ARGS]


def start(raw, out, unit: str) -> subprocess.Popen:
    return subprocess.Popen(prepare_cmd(raw, out, unit), cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def killed_at(raw, out, delay: float, unit: str) -> bool:
    """Start a run and SIGKILL it after `delay` seconds; True if it was still running then."""
    proc = start(raw, out, unit)
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
    raw = write_c4_corpus(work / "raw", copies=12, per_file=1)
    ref = work / "ref"
    t0 = time.monotonic()
    proc = subprocess.run(prepare_cmd(raw, ref), cwd=ROOT, env=base_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return raw, dir_bytes(ref), time.monotonic() - t0, ref


UNITS = {"blocks": ("prepare_sigkill", FAULT), "files": ("prepare_files_sigkill", f"{FAULT}, whole files")}


@pytest.mark.parametrize("unit", UNITS)
def test_rerun_after_sigkill_at_a_random_moment_is_byte_identical(reference, tmp_path, unit):
    raw, expected, duration, _ = reference
    name, fault = UNITS[unit]
    if unit != "blocks":  # kill moments span an uninterrupted run of this unit, which must give the same bytes
        t0 = time.monotonic()
        proc = subprocess.run(prepare_cmd(raw, tmp_path / "whole", unit), cwd=ROOT, env=base_env(), capture_output=True, text=True)
        duration = time.monotonic() - t0
        assert proc.returncode == 0 and dir_bytes(tmp_path / "whole") == expected, proc.stderr
    draw = rng(name)
    failures = []
    for trial in range(trials(name)):
        out = tmp_path / f"trial{trial}"
        delay = draw.uniform(0.05, duration)
        interrupted = killed_at(raw, out, delay, unit)
        if trial % 2 == 1 and interrupted:
            killed_at(raw, out, draw.uniform(0.05, duration), unit)  # kill the resumed run as well
        rerun = subprocess.run(prepare_cmd(raw, out, unit), cwd=ROOT, env=base_env(), capture_output=True, text=True)
        identical = rerun.returncode == 0 and dir_bytes(out) == expected
        record(fault, survived=identical, data_lost=not identical)
        if not identical:
            failures.append(f"trial {trial} (kill after {delay:.2f}s): rc {rerun.returncode}\n{rerun.stderr[-2000:]}")
    assert not failures, "\n".join(failures)


FAULT_PARTITION = "SIGKILL one of 3 prepare_data.py --partition parts"


def test_partitioned_run_with_a_killed_part_merges_to_the_single_run(reference, tmp_path):
    raw, expected, duration, ref = reference
    draw = rng("prepare_partition_sigkill")
    fake_srun(tmp_path / "bin", tmp_path / "srun.args", run=True)
    failures = []
    for trial in range(trials("prepare_partition_sigkill")):
        parts_dir = tmp_path / f"parts{trial}"
        args = ["--input", str(raw), *ARGS]
        for i in (0, 2):
            proc = array_task(parts_dir, i, 3, args, tmp_path / "bin")
            assert proc.returncode == 0, proc.stderr
        victim = parts_dir / "part-00001"
        delay = draw.uniform(0.05, duration / 2)
        env = base_env() | {"PATH": f"{tmp_path / 'bin'}:{base_env()['PATH']}", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_CPUS_PER_TASK": "2", "SLURM_SUBMIT_DIR": str(ROOT)}
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "prepare_array.sbatch"), str(parts_dir), *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(delay)
        except subprocess.TimeoutExpired:
            kill_group(proc, signal.SIGKILL)
            proc.wait()
        parts = [parts_dir / f"part-{i:05d}" for i in range(3)]
        refused_ok = True
        if not (victim / "manifest.json").exists():
            try:
                merge_parts(parts, tmp_path / f"early{trial}", log=lambda _: None)
                refused_ok = False
            except MergeError as e:
                # Killed before it made its directory ("no such part directory") or after ("incomplete part").
                refused_ok = str(e).startswith(f"{victim}: ") and ("incomplete part" in str(e) or "no such part directory" in str(e))
        rerun = array_task(parts_dir, 1, 3, args, tmp_path / "bin")
        merged = tmp_path / f"merged{trial}"
        ok = refused_ok and rerun.returncode == 0
        if ok:
            merge_parts(parts, merged, log=lambda _: None)
            got = dir_bytes(merged)
            tokens = [k for k in expected if k.endswith((".bin", ".npy"))]
            ok = all(got.get(k) == expected[k] for k in tokens) and sorted(k for k in got if k.endswith((".bin", ".npy"))) == sorted(tokens)
            ok = ok and TokenSource(merged).fingerprint() == TokenSource(ref).fingerprint()
        record(FAULT_PARTITION, survived=ok, data_lost=not ok)
        if not ok:
            failures.append(f"trial {trial} (kill after {delay:.2f}s): merge refused the unfinished part: {refused_ok}; rerun rc {rerun.returncode}\n{rerun.stderr[-2000:]}")
    assert not failures, "\n".join(failures)
