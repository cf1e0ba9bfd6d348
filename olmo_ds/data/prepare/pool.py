"""A pool of worker processes that returns results in submission order, built for bulk token output.

Data preparation is bound by how little the coordinating process does per block, so this pool
avoids what `multiprocessing.Pool` costs there: no handler threads in the parent (results are read
by the caller, in order, straight from each worker's pipe), no pickling or piping of the bulk result
(a worker copies its token array into one of its shared-memory slots and sends only a small header),
and no hang when a worker dies (the parent's read of its pipe ends and raises `WorkerDied` naming
the exit code).

Why slots: a pipe moves about 1 GB/s with both ends copying, and on the 2-core VM we measure on a
worker then spent a fifth of its time sending its ids. With the fork start method each worker gets
`depth` anonymous shared mappings (created before the fork, so nothing is left in /dev/shm if the
whole process group is killed); result j goes to slot j mod `depth`, and the parent copies it out
(memory speed) before it sends that worker the task that will reuse the slot. A result larger than a
slot, or any result when workers are not forked, goes through the pipe as raw bytes.

Each block goes to the worker with the fewest in flight and the parent remembers which, so results
come back in order by reading that worker's pipe. At most `depth` blocks per worker are in flight,
which bounds memory (deeper queues measured slower: the coordinating process then tokenizes less
and waits more). Each worker drains its task pipe in a thread, so a parent writing a large task
never waits on a worker that is itself waiting to write a large result.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
from collections import deque
from typing import Callable, Iterable, Iterator

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

_STOP = None


class WorkerDied(RuntimeError):
    pass


def _drain(conn, tasks: queue.Queue) -> None:
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            msg = _STOP
        tasks.put(msg)
        if msg is _STOP:
            return


def _worker(fn: Callable, context, task_conn, result_conn, parent_fds: list[int], slots: list | None) -> None:
    """Run `fn(context, *args)` for each task; put the array in the task's slot (or send its raw bytes
    after the header), or send the error. `parent_fds`: the parent's pipe ends a forked child
    inherited; closing them lets every worker see the end of its task pipe (and exit) when the parent dies."""
    for fd in parent_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    tasks: queue.Queue = queue.Queue()
    threading.Thread(target=_drain, args=(task_conn, tasks), daemon=True).start()
    done = 0  # tasks answered: result j goes to slot j mod len(slots)
    while (args := tasks.get()) is not _STOP:
        k = done % len(slots) if slots else None
        done += 1
        try:
            header, array = fn(context, *args)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which re-raises it
            result_conn.send(("error", _picklable(e)))
            continue
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        if k is not None and data.nbytes <= len(slots[k]):
            slots[k][: data.nbytes] = data
            result_conn.send((k, header, array.dtype.str, array.shape))
        else:
            result_conn.send((None, header, array.dtype.str, array.shape))  # the raw bytes follow
            result_conn.send_bytes(data)


def _died(p) -> WorkerDied:
    p.join(timeout=5)
    return WorkerDied(f"worker process {p.pid} died (exit code {p.exitcode}); nothing after the last complete shard was kept")


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def _widen(conn, size: int = 8 << 20) -> None:
    """Grow a pipe's buffer (Linux, default 64 KiB) so that a worker writes a block's result in one go
    instead of waiting for the parent to drain each 64 KiB; capped by what the system allows."""
    setpipe = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl else None
    if setpipe is None:
        return
    for n in (size, 1 << 20):
        with contextlib.suppress(OSError):
            fcntl.fcntl(conn.fileno(), setpipe, n)
            return


class _Workers:
    """Worker processes, each fed through a task pipe and answering through a result pipe; a context
    manager that stops them on exit: politely when all went well, at once after an error."""

    procs: list
    task_conns: list
    result_conns: list
    closed = False

    def _spawn(self, mp_context, target: Callable, fn: Callable, context, extra, widen: bool = False) -> None:
        """Start one worker `target(fn, context, task_conn, result_conn, parent_fds, extra)`. Under fork
        the child closes the parent's ends of every pipe made so far (`parent_fds`), so a parent's
        death is an EOF it sees."""
        task_r, task_w = mp_context.Pipe(duplex=False)
        result_r, result_w = mp_context.Pipe(duplex=False)
        if widen:
            _widen(result_r)
        forked = mp_context.get_start_method() == "fork"
        parent_fds = [c.fileno() for c in (*self.task_conns, *self.result_conns, task_w, result_r)] if forked else []
        p = mp_context.Process(target=target, args=(fn, context, task_r, result_w, parent_fds, extra), daemon=True)
        p.start()
        task_r.close()
        result_w.close()
        self.procs.append(p)
        self.task_conns.append(task_w)
        self.result_conns.append(result_r)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: when idle, politely; otherwise (an error) at once. Once is enough."""
        if self.closed:
            return
        self.closed = True
        for conn in self.task_conns:
            with contextlib.suppress(OSError):
                conn.send(_STOP)
        for p in self.procs:
            if not kill:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
            p.join()
        for conn in (*self.task_conns, *self.result_conns):
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(kill=exc_type is not None)


class OrderedPool(_Workers):
    """`fn(context, *args) -> (header, np.ndarray)` over `workers` processes, results in order.

    `context` is sent to each worker once (with the fork start method it is inherited, not pickled).
    """

    def __init__(self, fn: Callable, context, workers: int, mp_context, depth: int = 2, slot_bytes: int = 8 << 20):
        self.fn, self.context, self.depth = fn, context, depth
        self.procs, self.task_conns, self.result_conns = [], [], []
        forked = mp_context.get_start_method() == "fork"
        # Only the pages a result touches become resident, so a generous slot costs nothing unused.
        self.slots = [[mmap.mmap(-1, slot_bytes) for _ in range(depth)] for _ in range(workers)] if forked else None
        for w in range(workers):
            self._spawn(mp_context, _worker, fn, context, self.slots[w] if forked else None, widen=True)

    def imap(self, tasks: Iterable[tuple], work_here: bool = True) -> Iterator[tuple[object, np.ndarray]]:
        """Yield `(header, array)` for each task's args, in the order of `tasks`.

        Every worker's queue is kept `depth` deep. With `work_here`, whenever the next result in
        order is not ready yet, this process runs the next task itself instead of waiting, so N
        workers plus the coordinating process use N + 1 cores' worth of time that would otherwise
        be idle (prepare_data does this when it has no spare core: `prepare.pool_layout`).
        """
        tasks = iter(tasks)
        order: deque = deque()  # per task in order: the worker it went to, or ("here", result)
        queued = [0] * len(self.procs)
        here = 0
        exhausted = False

        def take() -> tuple | None:
            nonlocal exhausted
            args = next(tasks, None)
            exhausted = args is None
            return args

        while True:
            while not exhausted and (worker := min(range(len(queued)), key=queued.__getitem__)) is not None and queued[worker] < self.depth:
                if (args := take()) is None:
                    break
                try:
                    self.task_conns[worker].send(args)
                except ConnectionError as e:  # it died since its last result (a broken pipe)
                    raise _died(self.procs[worker]) from e
                queued[worker] += 1
                order.append(worker)
            if not order:
                return
            head = order[0]
            if work_here and isinstance(head, int) and not exhausted and here < self.depth and not self.result_conns[head].poll():
                if (args := take()) is not None:
                    order.append(("here", self.fn(self.context, *args)))
                    here += 1
                continue
            order.popleft()
            if isinstance(head, int):
                queued[head] -= 1
                yield self._receive(head)
            else:
                here -= 1
                yield head[1]

    def _receive(self, worker: int) -> tuple[object, np.ndarray]:
        conn = self.result_conns[worker]
        try:
            msg = conn.recv()
            if msg[0] == "error":
                raise msg[1]
            slot, header, dtype, shape = msg
            if slot is not None:
                array = np.frombuffer(self.slots[worker][slot], dtype=np.dtype(dtype), count=int(np.prod(shape))).reshape(shape).copy()
            else:
                array = np.frombuffer(conn.recv_bytes(), dtype=np.dtype(dtype)).reshape(shape)
        except (EOFError, ConnectionError) as e:
            raise _died(self.procs[worker]) from e
        return header, array


def _die_with_parent(parent: int) -> None:
    """Linux: be killed when the parent dies. A `TaskPool` worker writes files (prepare's shards); one
    that outlived a killed parent could still be writing while a rerun writes the same names."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


def _task_worker(fn: Callable, context, task_conn, result_conn, parent_fds: list[int], parent: int) -> None:
    """Run `fn(context, task)` for each task received and send back its result, or the error."""
    _die_with_parent(parent)
    for fd in parent_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    while True:
        try:
            task = task_conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is _STOP:
            return
        try:
            result = ("ok", fn(context, task))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which re-raises it
            result = ("error", _picklable(e))
        result_conn.send(result)


class TaskPool(_Workers):
    """`fn(context, task) -> result` over `workers` processes, one task per worker at a time, each
    result returned as soon as it is ready (the caller restores any order it needs).

    For tasks of very different lengths (data preparation's whole files): a worker that finishes
    takes the next task at once instead of queuing behind a long one, as `OrderedPool`'s per-worker
    queues would. Results come back pickled through pipes, so they should be small (the bulk output
    goes to files). A worker's death raises `WorkerDied`, as in `OrderedPool`; the parent's kills
    the workers (Linux), since they may be writing files.
    """

    def __init__(self, fn: Callable, context, workers: int, mp_context):
        self.procs, self.task_conns, self.result_conns = [], [], []
        self.running: dict[int, object] = {}  # worker -> key of the task it runs
        for _ in range(workers):
            self._spawn(mp_context, _task_worker, fn, context, os.getpid())

    @property
    def idle(self) -> int:
        return len(self.procs) - len(self.running)

    def idle_workers(self) -> list[int]:
        return [w for w in range(len(self.procs)) if w not in self.running]

    def submit(self, key, task, worker: int | None = None) -> None:
        """Give `task` to `worker` (idle), or to any idle worker; `key` comes back with its result."""
        if worker is None:
            worker = self.idle_workers()[0]
        assert worker not in self.running, f"worker {worker} is busy"
        self.task_conns[worker].send(task)
        self.running[worker] = key

    def wait(self) -> list[tuple[object, object]]:
        """Block until at least one running task is done: `[(key, result), ...]`; re-raises a task's error."""
        from multiprocessing.connection import wait

        by_conn = {self.result_conns[w]: w for w in self.running}
        done = []
        for conn in wait(list(by_conn)):
            worker = by_conn[conn]
            try:
                status, value = conn.recv()
            except (EOFError, ConnectionError) as e:
                raise _died(self.procs[worker]) from e
            key = self.running.pop(worker)
            if status == "error":
                raise value
            done.append((key, value))
        return done

