"""One live run per run dir: rank 0 holds a lock on RUN/run.lock for the life of its process.

    lock = lock_run_dir(run_dir)   # a ConfigError naming the holder (host, pid, since when) if a live run has it
    lock.record()                  # once the start is accepted: this process is the holder

Two runs in one run dir prune each other's checkpoints and write one metrics.jsonl (issue 35: a `--resume auto`
crashed inside DeepSpeed while orphaned ranks of the first run trained on). The lock is a POSIX record lock
(`fcntl.lockf`) on a file inside the run dir, taken without waiting:

- the kernel drops it when the process ends, however it ends (SIGKILL, OOM, a node reboot ends the NFS lease),
  so no stale lock ever blocks a restart and no one has to delete a file by hand;
- unlike `flock`, a record lock is not inherited by processes forked from the holder (data workers, compile
  workers), which could otherwise keep a dead run's dir locked;
- NFS (v3 with lockd, v4), GPFS and Lustre mounted with `-o flock` share record locks between hosts, so on a
  shared filesystem a second run started from another node is refused too. Where the filesystem has no locks
  (Lustre's default `noflock`, NFS without lockd: ENOLCK, ENOSYS, EOPNOTSUPP) the run goes on unlocked with a
  warning: two runs there are not stopped.

Only the process that claims the run dir holds the lock: rank 0 (`olmo_ds.train.plan.claim_run_dir`), on
whatever node it runs. The other ranks of a refused launch stop with it (the launcher ends them when rank 0
exits, or the rendezvous reports rank 0 missing). Record locks belong to a process, not to a file handle, so
this process keeps one handle per run dir (`_HELD`): opening and closing a second would drop the lock.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from olmo_ds.train.config import ConfigError

log = logging.getLogger("olmo_ds")

LOCK_FILE = "run.lock"
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


@dataclass
class RunDirLock:
    run_dir: Path
    file: IO[str] | None  # None once released
    locked: bool  # False where the filesystem has no locks
    created: bool = False  # this process made the run dir (it did not exist when locked)

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    def record(self) -> None:
        """Write this process as the holder: host, pid, since when, the command (what a refused start names)."""
        if self.file is None:
            return
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                  "command": " ".join(sys.argv)[:500]}
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(holder) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def release(self) -> None:
        """Drop the lock now (the file stays: deleting a lock file races with a process about to lock it)."""
        if self.file is not None:
            _HELD.pop(_key(self.run_dir), None)
            self.file.close()
            self.file = None

    def abandon(self) -> None:
        """A start that ends before it trained (refused, Ctrl-C in the engine's set-up, a failed reference pass): drop
        the lock, and where this process made the run dir and nothing but the lock file is in it, remove both, so the
        start leaves the run dir as it found it. Anything else written there stays (a cache the next start reuses).
        The file goes while still locked: a start that opens the path from then on makes a file of its own."""
        if self.file is None:
            return
        if self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()
        self.release()


_HELD: dict[Path, RunDirLock] = {}


def _key(run_dir: Path) -> Path:
    return Path(os.path.realpath(run_dir))


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Lock `run_dir` (created if missing) for this process, or raise a ConfigError naming the live run that holds it."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    if (held := _HELD.get(_key(run_dir))) is not None:
        return held
    f = open(run_dir / LOCK_FILE, "a+")  # created if missing, never truncated before it is held
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            f.seek(0)
            holder = describe_holder(f.read())
            f.close()
            raise ConfigError(
                f"run_dir {run_dir} is in use by a live run: {holder} holds {run_dir / LOCK_FILE}. Two runs in one run dir "
                f"would prune each other's checkpoints; wait for it to end, stop it (SIGTERM or Ctrl-C saves a checkpoint, "
                f"then --resume auto continues), or choose another run_dir"
            ) from None
        if e.errno not in _NO_LOCKS:
            f.close()
            raise
        log.warning("%s: this filesystem does not support file locks (%s), so a second run started in %s would not be "
                    "stopped; on Lustre mount with -o flock, on NFS run lockd", run_dir / LOCK_FILE, os.strerror(e.errno), run_dir)
        locked = False
    lock = _HELD[_key(run_dir)] = RunDirLock(run_dir, f, locked, created)
    return lock


def describe_holder(text: str) -> str:
    """"pid 123 on host gpu07 since 2025-01-01 10:00:00 UTC (python scripts/pretrain.py ...)" from the lock file's text."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on host {h['host']} since {h['since']} ({h['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet (it is starting)"
