"""W&B logging with the real wandb package in offline mode: what it records is what metrics.jsonl says.

A 2-rank run is preempted (SIGTERM) and resumed in the same run directory; W&B must hold one run id
across both starts, one offline run directory per start (rank 1 writes none), each finished, and
together the same train/loss at the same steps, bit for bit, as metrics.jsonl. W&B failures that
happen on clusters (no server, its wandb-core process killed) must leave training and the other logs
running. Everything is hermetic: offline or pointed at a closed local port, with W&B's settings and
caches under the test's tmp directory.

wandb ships no Python reader for its run files (`run-ID.wandb`) any more, so `wandb_records` reads
them here: a LevelDB log (a 7-byte `:W&B` header, 32 KiB blocks, records split into chunks with a
7-byte header each) whose payloads are `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from train_testlib import ROOT, free_port, launch_env, losses_by_step, read_metrics, run, tiny_config, torchrun_cmd, write_config, \
    write_markov_shards

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb is not installed (pip install -e '.[wandb]')")

PRETRAIN = ROOT / "scripts" / "pretrain.py"
PROJECT = "olmo-ds-test"


def hermetic_wandb_env(monkeypatch, tmp: Path, **settings: str) -> None:
    """W&B settings for this test only, in os.environ (which the launch helpers copy to the ranks)."""
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    home = tmp / "wandb-home"
    defaults = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")}
    for key, value in {**defaults, **settings}.items():
        monkeypatch.setenv(key, value)


def wandb_records(path: Path):
    """Every Record in a wandb run file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file (header {data[:7]!r})"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a chunk header: zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def items(entries) -> dict:
    """Key-value entries of a record; wandb-core stores a key as `key` or as a one-element `nested_key`."""
    return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}


def read_offline_run(run_file: Path) -> dict:
    """The run id, config, logged history by step, last summary values and exit code of one offline run."""
    out = {"history": {}, "summary": {}, "exit_code": None}
    for r in wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["project"], out["name"] = r.run.run_id, r.run.project, r.run.display_name
            out["config"] = items(r.run.config.update)
        elif kind == "history":
            row = items(r.history.item)
            out["history"][row.pop("_step")] = row
        elif kind == "summary":
            out["summary"].update(items(r.summary.update))
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.multirank
def test_preempted_and_resumed_run_is_one_wandb_run_matching_metrics_jsonl(tmp_path, monkeypatch):
    hermetic_wandb_env(monkeypatch, tmp_path)
    data = write_markov_shards(tmp_path / "shards")
    cfg = tiny_config(tmp_path, data, max_steps=400, checkpoint={"every": 0, "keep_last": 2},
                      logging={"every": 1, "tensorboard": False, "wandb": True, "wandb_project": PROJECT})
    config = write_config(tmp_path / "run.yaml", cfg)
    run_dir = Path(cfg["run_dir"])

    # Start 1: preempted after a few steps; SIGTERM goes to every rank, as Slurm and Kubernetes send it.
    proc = subprocess.Popen(torchrun_cmd(PRETRAIN, "--config", str(config), "--resume", "auto"), env=launch_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600  # a fresh checkout's first start JIT-builds DeepSpeed ops for minutes
    try:
        while not read_metrics(run_dir) or read_metrics(run_dir)[-1]["step"] < 3:
            assert proc.poll() is None, f"run ended early: {proc.communicate()[0].decode()[-4000:]}"
            assert time.time() < deadline, "step 3 not reached in 600 s"
            time.sleep(0.05)
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "pretrain.py" in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:  # a short-lived helper process ended meanwhile
                pass
        out = proc.communicate(timeout=300)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    stopped = read_metrics(run_dir)[-1]["step"]
    assert 3 <= stopped < 400

    # Start 2: resumed in the same run directory, to a normal end two steps later.
    ok(run(torchrun_cmd(PRETRAIN, "--config", str(config), "--resume", "auto", "--set", f"max_steps={stopped + 2}")))

    run_id = (run_dir / "wandb_id").read_text().strip()
    run_dirs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in run_dirs] == [run_id, run_id], f"expected one offline run per start: {run_dirs}"
    first, second = (read_offline_run(d / f"run-{run_id}.wandb") for d in run_dirs)
    for start in (first, second):
        assert (start["id"], start["project"], start["name"]) == (run_id, PROJECT, run_dir.name)
        assert start["exit_code"] == 0, "the W&B run was not finished"
        assert start["config"]["logging"]["wandb"] is True and start["config"]["batch"]["global_batch_size"] == 8
    assert first["config"]["max_steps"] == 400 and second["config"]["max_steps"] == stopped + 2
    assert sorted(first["history"]) == list(range(1, stopped + 1))
    assert sorted(second["history"]) == [stopped + 1, stopped + 2], "the resumed start did not continue the step axis"

    expected = {m["step"]: m for m in read_metrics(run_dir)}
    logged = {**first["history"], **second["history"]}
    assert {s: row["train/loss"] for s, row in logged.items()} == losses_by_step(run_dir)
    for step, row in logged.items():
        assert row["train/lr"] == expected[step]["train/lr"] and row["train/tokens_seen"] == expected[step]["train/tokens_seen"]
        assert "perf/mfu" not in row, "a None metric (MFU on CPU) was sent to W&B"
    assert second["summary"]["train/loss"] == expected[stopped + 2]["train/loss"]


@pytest.mark.multirank
def test_unreachable_server_leaves_training_and_other_logs_running(tmp_path, monkeypatch):
    """Online mode with a key but no server (a closed local port): init gives up after WANDB_INIT_TIMEOUT, the job goes on."""
    hermetic_wandb_env(monkeypatch, tmp_path, WANDB_MODE="online", WANDB_API_KEY="0" * 40,
                       WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}", WANDB_INIT_TIMEOUT="3")
    data = write_markov_shards(tmp_path / "shards")
    cfg = tiny_config(tmp_path, data, max_steps=3, checkpoint={"every": 0, "keep_last": 2},
                      logging={"every": 1, "tensorboard": True, "wandb": True, "wandb_project": PROJECT})
    config = write_config(tmp_path / "run.yaml", cfg)
    result = run(torchrun_cmd(PRETRAIN, "--config", str(config)))
    ok(result)
    assert "W&B could not start (CommError" in result.stdout and "logging to metrics.jsonl and TensorBoard only" in result.stdout, \
        result.stdout[-4000:]
    run_dir = Path(cfg["run_dir"])
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3]
    assert any((run_dir / "tb").iterdir()), "no TensorBoard events"


# Drives MetricsLogger as the trainer does (log per step, close in `finally`) in a fresh process, so that
# W&B's process-wide state (its service, the wrapped stdout) stays out of pytest's process.
LOGGER_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import psutil

    if sys.argv[2] == "not-installed":
        sys.modules["wandb"] = None  # what `import wandb` meets without the package: ImportError
    from olmo_ds.train.metrics import MetricsLogger, setup_console_logging

    setup_console_logging(0)
    run_dir, action = Path(sys.argv[1]), sys.argv[2]
    logger = MetricsLogger(run_dir, enabled=True, tensorboard=False, wandb=True, wandb_project="olmo-ds-test", config={"seed": 1})
    print("W&B started:", logger.wandb is not None, flush=True)
    if action == "kill-service":  # as the OOM killer would
        for p in psutil.Process().children(recursive=True):
            if p.name() == "wandb-core":
                p.kill()
                p.wait()
    try:
        for step in (1, 2, 3):
            logger.log(step, {"train/loss": 1.0 / step, "perf/mfu": None})
        if action == "raise":
            raise RuntimeError("step 3: loss diverged")
    finally:
        logger.close()
""")


@pytest.mark.parametrize("action", ["no-api-key", "not-installed", "kill-service", "raise"])
def test_wandb_failures_warn_and_keep_metrics_jsonl(action, tmp_path, monkeypatch):
    hermetic_wandb_env(monkeypatch, tmp_path, **({"WANDB_MODE": "online"} if action == "no-api-key" else {}))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a real key
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", LOGGER_SCRIPT, str(run_dir), action], env=launch_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == (1 if action == "raise" else 0), out[-4000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    expected = {
        "no-api-key": "W&B could not start (UsageError: No API key configured",
        "not-installed": "logging.wandb is true but wandb is not installed (pip install -e '.[wandb]'); logging to metrics.jsonl only",
        "kill-service": "W&B failed while logging step 1 (",
        "raise": "W&B started: True",
    }[action]
    assert expected in out, out[-4000:]
    if action == "kill-service":
        assert out.count("W&B failed while") == 1, "warn once, then W&B stays off"
    if action == "raise":  # the run is marked failed in W&B, not finished
        run_id = (run_dir / "wandb_id").read_text().strip()
        (run_file,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        logged = read_offline_run(run_file)
        assert logged["exit_code"] == 1 and sorted(logged["history"]) == [1, 2, 3]
