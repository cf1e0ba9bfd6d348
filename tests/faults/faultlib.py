"""Shared machinery of the fault-injection suite: trial counts, the report, process launch and kill.

One code path serves both runs: `make test` (inside `pytest tests`) runs each fault a few times
(`OLMO_DS_FAULT_TRIALS=sample`, the default), `make test-faults` sets `OLMO_DS_FAULT_TRIALS=full` and
runs the same tests with the trial counts of `TRIALS`. Kill moments come from a seeded generator;
the seed (`OLMO_DS_FAULT_SEED`, random by default) is printed with the report so a failing trial
can be replayed.

Every test records one row per fault kind (`record`): trials, survived, and data lost (a trial
whose earlier complete output, shards or checkpoint, was damaged or could no longer be loaded).
`conftest.py` prints the table at the end of the session.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from olmo_ds.train.launch import free_port
from testdata import SHARED, pythonpath

ROOT = Path(__file__).resolve().parents[2]
NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
C4_DIR = SHARED / "data" / "c4-sample"

MODE = os.environ.get("OLMO_DS_FAULT_TRIALS", "sample")
if MODE not in ("sample", "full"):
    raise ValueError(f"OLMO_DS_FAULT_TRIALS={MODE!r}: expected 'sample' or 'full'")
SEED = int(os.environ.get("OLMO_DS_FAULT_SEED", random.SystemRandom().randrange(2**31)))

# fault -> (trials in the sampled run, trials in the full run)
TRIALS = {
    "prepare_sigkill": (2, 12),
    "prepare_files_sigkill": (2, 12),  # the same with --work-unit files
    "prepare_partition_sigkill": (1, 6),  # M = 3 parts, one of them killed
    "train_kill_chains": (1, 2),  # independent runs, each killed `train_kills_per_chain` times
    "train_kills_per_chain": (1, 11),
    "train_sigterm": (0, 2),  # one SIGTERM per chain (in `make test` tests/train/test_pretrain_multirank.py has one)
    "train_async_kills_per_chain": (1, 3),  # SIGKILL while a background save (checkpoint.async_save: always) is in flight
    "train_async_sigterm": (1, 2),  # one SIGTERM per chain while a background save is in flight
}


def trials(name: str) -> int:
    sample, full = TRIALS[name]
    return full if MODE == "full" else sample


def rng(name: str) -> random.Random:
    """A generator per test, so one test's draws do not shift another's when run alone."""
    return random.Random(f"{SEED}:{name}")


@dataclasses.dataclass
class Row:
    fault: str
    trials: int = 0
    survived: int = 0
    data_lost: int = 0
    source: str = "tests/faults"


RESULTS: dict[str, Row] = {}


def record(fault: str, *, survived: bool, data_lost: bool = False, source: str = "tests/faults") -> None:
    row = RESULTS.setdefault(fault, Row(fault, source=source))
    row.trials += 1
    row.survived += int(survived)
    row.data_lost += int(data_lost)


def format_table(rows: list[Row]) -> str:
    width = max([len(r.fault) for r in rows] + [len("fault")])
    lines = [f"{'fault':<{width}}  {'trials':>6}  {'survived':>8}  {'data lost':>9}  source",
             f"{'-' * width}  {'-' * 6}  {'-' * 8}  {'-' * 9}  {'-' * 6}"]
    for r in rows:
        lines.append(f"{r.fault:<{width}}  {r.trials:>6}  {r.survived:>8}  {r.data_lost:>9}  {r.source}")
    return "\n".join(lines)


def check(fault: str, action, pattern: str, untouched: Path | None = None, errors=(ValueError, FileNotFoundError)) -> None:
    """`action()` must raise one of `errors` whose message matches `pattern`; `untouched` keeps its bytes."""
    before = dir_bytes(untouched) if untouched is not None and untouched.exists() else None
    message = None
    try:
        action()
    except errors as e:
        message = str(e)
    intact = before is None or dir_bytes(untouched) == before
    ok = message is not None and re.search(pattern, message) is not None
    record(fault, survived=ok and intact, data_lost=not intact)
    assert message is not None, f"{fault}: no error"
    assert ok, f"{fault}: message {message!r} does not match {pattern!r}"
    assert intact, f"{fault}: {untouched} changed"


# --- files ---------------------------------------------------------------------------------------


def dir_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def write_c4_corpus(raw: Path, copies: int, per_file: int = 3) -> Path:
    """Real C4 web text as JSON lines, `copies` times over, `per_file` copies to a file."""
    raw.mkdir(parents=True, exist_ok=True)
    texts = []
    for path in sorted(C4_DIR.glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            texts += [json.loads(line)["text"] for line in f]
    for c in range(copies):
        with open(raw / f"part-{c // per_file:03d}.jsonl", "a") as f:
            for t in texts:
                f.write(json.dumps({"text": t, "copy": c}) + "\n")
    return raw


# --- processes -----------------------------------------------------------------------------------


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process and everything it started (it leads its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_for(predicate, timeout: float, poll: float = 0.002, procs: list[subprocess.Popen] = ()) -> bool:
    """Poll until `predicate()` holds; False on timeout or when one of `procs` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if any(p.poll() is not None for p in procs):
            return bool(predicate())
        time.sleep(poll)
    return False


class Ranks:
    """Two (or N) ranks of scripts/pretrain.py started the way the deepspeed launcher starts them:
    RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment, one process each,
    all in one process group (so a SIGKILL of the group is a node losing power), each rank's output
    in its own log file."""

    def __init__(self, config: Path, logs: Path, *, world: int = 2, args: tuple[str, ...] = ("--resume", "auto"), preexec_fn=None):
        logs.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        self.logs = [logs / f"rank{r}.log" for r in range(world)]
        self.procs: list[subprocess.Popen] = []
        for r in range(world):
            env = base_env() | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            group = {"process_group": 0 if r == 0 else self.procs[0].pid}
            with open(self.logs[r], "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config), *args],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec_fn, **group,
                ))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        kill_group(self.procs[0], sig)

    def signal_each(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                self.kill()
                p.wait()
                raise
        return codes

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log(r)[-n:]}" for r in range(len(self.procs)))
