"""One rank of a 2-rank run dies (SIGKILL): the others stop within a bounded time and say which rank.

Three ways a run is started: the `deepspeed` launcher and `torchrun`, which supervise the ranks of
their node, and bare ranks (what each node of a multi-node job looks like to the others, where no
local supervisor sees the dead rank). In every case the survivor must exit, not hang, within
`BOUND` seconds of the death, and some output must name the rank that died.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.faultlib import MODE, ROOT, Ranks, base_env, kill_group, record, wait_for
from tests.train.train_testlib import deepspeed_cmd, tiny_config, torchrun_cmd, write_config, write_markov_shards

FAULT = "one rank of 2 dies (SIGKILL)"
BOUND = float(os.environ.get("OLMO_DS_RANK_DEATH_BOUND", 60))
PRETRAIN = ROOT / "scripts" / "pretrain.py"

pytestmark = [pytest.mark.multirank, pytest.mark.skipif(MODE != "full", reason="2-rank launches: make test-faults")]



def exit_within(proc: subprocess.Popen, t0: float) -> tuple[float, bool]:
    """Wait up to BOUND seconds for `proc` to exit; (seconds since t0, whether it exited)."""
    try:
        proc.wait(BOUND)
    except subprocess.TimeoutExpired:
        pass
    return time.monotonic() - t0, proc.poll() is not None

@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("rank_death")
    data = write_markov_shards(tmp / "data")
    cfg = tiny_config(tmp, data, max_steps=400, checkpoint={"every": 0, "save_final": False}, logging={"every": 1, "tensorboard": False})
    return write_config(tmp / "run.yaml", cfg)


def metrics_path(config: Path) -> Path:
    import yaml

    return Path(yaml.safe_load(config.read_text())["run_dir"]) / "metrics.jsonl"


def training(path: Path, since: float) -> bool:
    """More than two steps logged since the time `since` (a launch moves the lines of the one before it aside)."""
    if not path.exists():
        return False
    text = path.read_text()
    return sum(json.loads(line)["time"] >= since for line in text[: text.rfind("\n") + 1].splitlines()) > 2


def descendants(root: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def rank_pid(launcher: subprocess.Popen, local_rank: int) -> int | None:
    """The pid of the launcher's worker with LOCAL_RANK=local_rank (searched among its descendants)."""
    for pid in descendants(launcher.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"pretrain.py" in cmd and f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    return None


@pytest.mark.parametrize("launcher, victim", [("torchrun", 1), ("deepspeed", 0), ("bare", 1), ("bare", 0)])
def test_survivor_exits_in_bounded_time_naming_the_dead_rank(config, launcher, victim, tmp_path):
    metrics = metrics_path(config)
    before = time.time() - 0.01
    if launcher == "bare":
        ranks = Ranks(config, tmp_path / "logs", args=("--resume", "auto", "--set", f"run_dir={metrics.parent}"))
        assert wait_for(lambda: training(metrics, before), 180, procs=ranks.procs), ranks.tail()
        ranks.procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        survivor = ranks.procs[1 - victim]
        elapsed, exited = exit_within(survivor, t0)
        if not exited:
            survivor.send_signal(signal.SIGABRT)  # with PYTHONFAULTHANDLER=1: where it hangs, into its log
            time.sleep(2)
        ranks.kill()
        output = ranks.log(1 - victim)
        rc = survivor.returncode
    else:
        # Every launch after the first finds the earlier one's metrics.jsonl: it continues that run (no checkpoints: from step 0).
        args = ("--config", str(config), "--resume", "auto")
        cmd = torchrun_cmd(PRETRAIN, *args) if launcher == "torchrun" else deepspeed_cmd(PRETRAIN, *args)
        log = tmp_path / "launcher.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        assert wait_for(lambda: training(metrics, before), 180, procs=[proc]), log.read_text()[-3000:]
        pid = rank_pid(proc, victim)
        assert pid is not None, "worker not found"
        subprocess.run(["kill", "-KILL", str(pid)])
        t0 = time.monotonic()
        elapsed, exited = exit_within(proc, t0)
        kill_group(proc)
        proc.wait()
        output = log.read_text(errors="replace")
        rc = proc.returncode
    names = naming(output, victim)
    record(FAULT, survived=exited and rc != 0 and names)
    assert exited, f"{launcher}: still running {BOUND}s after rank {victim} died\n{output[-3000:]}"
    assert rc != 0
    assert names, f"{launcher}: no message names rank {victim} (exited after {elapsed:.1f}s)\n{output[-4000:]}"


def naming(output: str, rank: int) -> bool:
    patterns = [
        rf"rank\s*:\s*{rank}\b",  # torchrun's "Root Cause" block
        rf"--local_rank={rank}.*exits with return code",  # the deepspeed launcher
        rf"rank {rank} (?:died|is gone|did not answer)",  # olmo-ds's own message
    ]
    return any(re.search(p, output) for p in patterns)
