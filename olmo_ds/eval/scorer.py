"""Scoring a batch of completions with their verifiers under a wall-clock and a memory limit, in worker processes:
a verifier that hangs, crashes or eats memory scores 0 with its reason, and the run goes on.

`verifiers.reward` runs in the calling process: a verifier stuck in C code (a regular expression, sympy) would stall
a training step for good, and a thread cannot be stopped (nor can math-verify's own SIGALRM timeout be set off the
main thread). So `Scorer` keeps a small pool of worker processes (`workers`, each started once and reused: a batch
costs one round trip per chunk, not one per sample) and watches each item's time:

- **timeout**: an item still unscored `timeout_s` seconds after its worker began it scores 0 with error "timeout
  after 10 s"; that worker is killed (with its process group) and replaced, and the rest of its chunk goes to a
  worker again;
- **crash**: a worker that dies (a segfault in a C extension, `os._exit`) gives its current item 0 and "crashed:
  SIGSEGV" (or "crashed: exit code 3"), and is replaced;
- **memory**: each worker runs under RLIMIT_AS `memory_mb`; a verifier's MemoryError gives 0 and "out of memory",
  and the worker is replaced (a process that ran out of memory is not trusted with the next item);
- any other failure is `reward`'s: 0 and "ExceptionClass: message".

Results come back in the items' order, one `verifiers.Reward` each, the same for any number of workers (each item
is scored alone; only verdicts that depend on time itself, a solution near its time limit, can differ between
runs). Defaults: `DEFAULT_TIMEOUT_S`, 30 s per item: open-instruct bounds a code verification request at
max(30, min(300, 10 x code_max_execution_time)) s, 30 s with its default 1 s per test
(open_instruct/ground_truth_utils.py at e6c3044, line 951; data_loader.py line 470), and the other verifiers'
own limits fit inside it (math-verify's 5 s parse and 5 s comparison, `verifiers._math`, as open-instruct's
math_utils.py line 182 uses 5 s; the code verifier's 1 s per test, `olmo_ds.eval.code`). `DEFAULT_MEMORY_MB`, 4 GiB
per worker. Verifiers added with `verifiers.register` reach the workers by reference (module and name).

`score_all(items, timeout_s=...)` scores with a pool kept for the process (started on first use, closed at exit), as
a training loop calls it every step.
"""

from __future__ import annotations

import atexit
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from olmo_ds.eval import verifiers
from olmo_ds.eval.code_harness import die_with_parent
from olmo_ds.eval.verifiers import OUT_OF_MEMORY, Reward

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MEMORY_MB = 4096
STARTUP_S = 120.0  # a worker's start (imports, math-verify's included); a worker that takes longer is a broken setup
CHUNKS_PER_WORKER = 4  # a batch goes out in about workers x this many chunks: few round trips, and a slow chunk is not alone


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class _Worker:
    proc: subprocess.Popen
    send: Connection
    recv: Connection
    chunk: tuple[int, int] | None = None  # [next item, end) of the chunk it is scoring
    began: float = 0.0  # when it began its current item


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class Scorer:
    """A pool of verifier worker processes (module docstring); `score(items, timeout_s)`; `close()` (or `with`)."""

    def __init__(self, workers: int | None = None, memory_mb: int | None = DEFAULT_MEMORY_MB):
        self.workers = workers or default_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if memory_mb is not None and memory_mb < 256:
            raise ValueError(f"memory_mb must be >= 256 (a worker imports the verifiers), got {memory_mb}")
        self.memory_mb = memory_mb
        self._pool: list[_Worker] = []
        self._lock = threading.Lock()
        self.replaced = 0  # workers killed or lost and started again, over the scorer's life

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def score(self, items, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Reward]:
        """One `Reward` per (verifier, completion, ground truth) item, in order (module docstring)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        items = [tuple(item) for item in items]
        if not items:
            return []
        extras = verifiers.registered()
        for name, fns in extras.items():
            try:
                pickle.dumps(fns)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise ValueError(f"registered verifier {name!r} cannot reach the scorer's workers: its functions must be module-level "
                                 f"(they are imported there by module and name): {e}") from None
        with self._lock:
            try:
                while len(self._pool) < self.workers:
                    self._pool += self._start(self.workers - len(self._pool))
                return self._score(items, extras, float(timeout_s))
            except BaseException:  # Ctrl-C or a failed start: results may be in flight; the next call starts clean workers
                self._stop_all()
                raise

    def _score(self, items: list[tuple], extras: dict, timeout_s: float) -> list[Reward]:
        size = max(1, -(-len(items) // (self.workers * CHUNKS_PER_WORKER)))
        todo = deque((a, min(a + size, len(items))) for a in range(0, len(items), size))
        out: list[Reward | None] = [None] * len(items)
        busy: list[_Worker] = []
        while todo or busy:
            for w in [w for w in self._pool if w.chunk is None]:
                if not todo:
                    break
                a, b = todo.popleft()
                try:
                    if w.proc.poll() is not None:
                        raise ConnectionError("the worker exited while idle")
                    w.send.send((extras, items[a:b]))
                except (BrokenPipeError, ConnectionError, OSError):  # died while idle: nothing of this chunk was scored
                    todo.appendleft((a, b))
                    self._replace(w, busy)
                    continue
                w.chunk, w.began = (a, b), time.monotonic()
                busy.append(w)
            now = time.monotonic()
            wait([w.recv for w in busy], timeout=max(0.0, min(w.began + timeout_s for w in busy) - now))
            for w in list(busy):
                while w.chunk is not None:  # every result it has sent
                    a, b = w.chunk
                    reward, lost = self._take(w, timeout_s)
                    if reward is None:
                        break
                    out[a] = reward
                    if lost:  # killed, died or ran out of memory: the rest of its chunk goes out again
                        if a + 1 < b:
                            todo.appendleft((a + 1, b))
                        self._replace(w, busy)
                        break
                    w.chunk, w.began = ((a + 1, b), time.monotonic()) if a + 1 < b else (None, 0.0)
                if w.chunk is None and w in busy:
                    busy.remove(w)
        return out

    def _take(self, w: _Worker, timeout_s: float) -> tuple[Reward | None, bool]:
        """(w's reward for item a, whether w is lost), or (None, False) while it is still working within its time."""
        if w.recv.poll():
            try:
                reward = w.recv.recv()
            except (EOFError, OSError):
                w.proc.wait()
                return Reward(0.0, f"crashed: {_signal_name(w.proc.returncode)}"), True
            except pickle.UnpicklingError as e:
                return Reward(0.0, f"crashed: unreadable result ({e})"), True
            return reward, reward.error == OUT_OF_MEMORY
        if time.monotonic() - w.began >= timeout_s:
            return Reward(0.0, f"timeout after {timeout_s:g} s"), True
        return None, False

    def _replace(self, w: _Worker, busy: list[_Worker]) -> None:
        self._stop(w)
        if w in busy:
            busy.remove(w)
        self._pool[self._pool.index(w)] = self._start(1)[0]
        self.replaced += 1

    def _start(self, n: int) -> list[_Worker]:
        started = []
        for _ in range(n):
            worker_r, parent_w = os.pipe()
            parent_r, worker_w = os.pipe()
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            code = f"from olmo_ds.eval.scorer import _worker; _worker({worker_r}, {worker_w}, {self.memory_mb!r}, {os.getpid()})"
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(worker_r, worker_w), stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            os.close(worker_r)
            os.close(worker_w)
            started.append(_Worker(proc, Connection(parent_w, readable=False), Connection(parent_r, writable=False)))
        deadline = time.monotonic() + STARTUP_S
        try:
            for w in started:
                if not w.recv.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"a verifier worker did not start within {STARTUP_S:g} s")
                try:
                    w.recv.recv()
                except EOFError:
                    w.proc.wait()
                    raise RuntimeError(f"a verifier worker failed to start ({_signal_name(w.proc.returncode)}; its error is printed above)") from None
        except BaseException:
            for w in started:
                self._stop(w)
            raise
        return started

    @staticmethod
    def _stop(w: _Worker) -> None:
        for conn in (w.send, w.recv):
            conn.close()
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.proc.wait()

    def close(self) -> None:
        with self._lock:
            self._stop_all()

    def _stop_all(self) -> None:
        for w in self._pool:
            self._stop(w)
        self._pool = []


def _worker(rfd: int, wfd: int, memory_mb: int | None, parent: int) -> None:
    """A worker's loop: (registered verifiers, items) in, one Reward per item out, as each is scored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    die_with_parent(parent=parent)
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    verifiers.math_verify_available()  # its import (sympy's) is paid at start, not in the first item's time
    recv, send = Connection(rfd, writable=False), Connection(wfd, readable=False)
    send.send("ready")
    while True:
        try:
            extras, items = recv.recv()
        except EOFError:
            return
        for name in set(verifiers.registered()) - set(extras):
            verifiers.unregister(name)
        for name, (score, check) in extras.items():
            verifiers.register(name, score, check)
        for verifier, completion, ground_truth in items:
            send.send(verifiers.reward(verifier, completion, ground_truth))


_shared: dict[tuple, Scorer] = {}


def score_all(items, *, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int | None = None,
              memory_mb: int | None = DEFAULT_MEMORY_MB) -> list[Reward]:
    """`Scorer.score` on a pool kept for this process per (workers, memory_mb), closed at exit."""
    key = (workers or default_workers(), memory_mb)
    if key not in _shared:
        if not _shared:
            atexit.register(close_all)
        _shared[key] = Scorer(*key)
    return _shared[key].score(items, timeout_s=timeout_s)


def close_all() -> None:
    """Stop `score_all`'s pools."""
    while _shared:
        _shared.popitem()[1].close()
