"""OrderedPool: results in order for any worker count, worker errors and deaths surface, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import multiprocessing as mp
import numpy as np
import psutil
import pytest

from olmo_ds.data.prepare.pool import OrderedPool, TaskPool, WorkerDied

REPO = Path(__file__).resolve().parents[2]


def square_block(context, i: int, n: int):
    """A result whose size and cost vary, so that workers finish out of order."""
    if i == context.get("fail_at"):
        raise ValueError(f"bad block {i}")
    if i == context.get("die_at"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.002 * (i % 3))
    return {"i": i, "pid": os.getpid()}, np.arange(n, dtype=np.uint32) * i


@pytest.mark.parametrize("workers, work_here, method", [(1, True, "fork"), (3, True, "fork"), (2, False, "fork"), (2, True, "spawn")])
def test_results_come_back_in_order(workers, work_here, method):
    tasks = [(i, (i * 7919) % 300_000) for i in range(60)]  # up to 1.2 MB of result, more than a pipe holds
    with OrderedPool(square_block, {}, workers, mp.get_context(method)) as pool:
        out = list(pool.imap(iter(tasks), work_here=work_here))
    assert [h["i"] for h, _ in out] == list(range(60))
    for (i, n), (_, arr) in zip(tasks, out):
        assert arr.dtype == np.uint32 and len(arr) == n and (n == 0 or int(arr[-1]) == (n - 1) * i)
    pids = {h["pid"] for h, _ in out}
    assert len(pids - {os.getpid()}) == workers  # every worker took part
    assert work_here or os.getpid() not in pids


def test_results_larger_than_a_slot_go_through_the_pipe():
    # 64 KiB slots: the larger results take the pipe, the rest the slots, interleaved per worker.
    tasks = [(i, (i * 7919) % 40_000) for i in range(80)]
    with OrderedPool(square_block, {}, 2, mp.get_context("fork"), slot_bytes=64 << 10) as pool:
        out = list(pool.imap(iter(tasks), work_here=False))
    assert sum(4 * n > 64 << 10 for _, n in tasks) > 10 and sum(4 * n <= 64 << 10 for _, n in tasks) > 10
    for (i, n), (h, arr) in zip(tasks, out):
        assert h["i"] == i and np.array_equal(arr, np.arange(n, dtype=np.uint32) * i)


def test_worker_error_is_raised_in_the_parent():
    with pytest.raises(ValueError, match="bad block 5"):
        with OrderedPool(square_block, {"fail_at": 5}, 2, mp.get_context("fork")) as pool:
            for _ in pool.imap(((i, 10) for i in range(20)), work_here=False):
                pass


def test_a_dead_worker_is_an_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="exit code -9"):
        with OrderedPool(square_block, {"die_at": 4}, 2, mp.get_context("fork")) as pool:
            for _ in pool.imap(((i, 10) for i in range(20)), work_here=False):
                pass
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("pool", ["OrderedPool", "TaskPool"])
def test_workers_exit_when_the_parent_is_killed(tmp_path, pool):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, sys, time
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from olmo_ds.data.prepare.pool import {pool} as Pool
        from test_pool import square_block
        pool = Pool(square_block, {{}}, 3, mp.get_context("fork"))
        print(" ".join(str(p.pid) for p in pool.procs), flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)
    for p in alive:
        p.kill()
    assert not alive, f"workers outlived their parent: {[p.pid for p in alive]}"


def sleepy_task(context, task):
    """Task i sleeps longer the smaller i is, so results come back out of submission order."""
    i = task
    if i == context.get("fail_at"):
        raise ValueError(f"bad task {i}")
    if i == context.get("die_at"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.03 * (3 - i % 4))
    return {"i": i, "pid": os.getpid()}


def run_tasks(pool: TaskPool, n: int) -> list:
    todo, done = list(range(n)), []
    while todo or pool.running:
        while todo and pool.idle:
            i = todo.pop(0)
            pool.submit(f"key{i}", i)
        done += pool.wait()
    return done


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_task_pool_returns_each_result_as_it_is_ready(method):
    with TaskPool(sleepy_task, {}, 3, mp.get_context(method)) as pool:
        done = run_tasks(pool, 12)
    assert sorted(key for key, _ in done) == sorted(f"key{i}" for i in range(12))
    assert all(key == f"key{r['i']}" for key, r in done)
    assert [r["i"] for _, r in done] != list(range(12))  # a worker that finished early took the next task
    assert len({r["pid"] for _, r in done}) == 3 and os.getpid() not in {r["pid"] for _, r in done}


def test_task_pool_raises_a_task_error_and_a_worker_death():
    with pytest.raises(ValueError, match="bad task 5"):
        with TaskPool(sleepy_task, {"fail_at": 5}, 2, mp.get_context("fork")) as pool:
            run_tasks(pool, 10)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="exit code -9"):
        with TaskPool(sleepy_task, {"die_at": 4}, 2, mp.get_context("fork")) as pool:
            run_tasks(pool, 10)
    assert time.monotonic() - t0 < 30
