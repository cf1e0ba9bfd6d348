"""The supervisor of one code-verifier run: a Python solution against its tests, each test in a fresh child process.

Run as a script by `olmo_ds.eval.code` (`python -I code_harness.py`, its own session and process group, a fresh
temporary directory as cwd, an emptied environment); it reads one JSON object on stdin, `{"program", "tests",
"test_s", "memory_mb", "max_forks"}`, and writes one JSON line per test on stdout, `{"test": i, "status": ...}`,
status "pass" or why not ("AssertionError", "timeout after 1 s", "out of memory", "blocked: socket", "crashed:
SIGSEGV", ...). It imports nothing of olmo_ds, so the solution's interpreter starts lean.

Each test runs as open-instruct's code verifier runs one (open_instruct/code_utils/code_utils.py at e6c3044,
`run_individual_test_helper`, lines 123-143, called per test by `get_successful_tests_fast`, lines 146-190): a new
process execs the program, then the test, in one namespace whose `__name__` is not "__main__" (so a solution's
`if __name__ == "__main__":` block does not run and wait for input); the test passes when it returns. Here the
process is forked from this supervisor, which runs no solution code itself, so a test that hangs, crashes or
exhausts memory costs that test alone.

In the test's process, before any solution code: its own process group (killed whole when the test ends, passed or
not); death with its parent (`die_with_parent`, Linux's PR_SET_PDEATHSIG, set again in every process it forks);
resource limits (RLIMIT_AS `memory_mb`, RLIMIT_CPU the test's seconds + 1, RLIMIT_FSIZE 64 MiB, no core files);
stdin, stdout and stderr on /dev/null; and a Python audit hook (PEP 578) that refuses socket creation (no
network), starting other programs (`os.system`, `os.exec*`, `os.posix_spawn`, `subprocess`, which would leave the
hook behind), ctypes, and forks past `max_forks` or from a forked child. This is a guard against accidents and
runaway code, not a sandbox: audit hooks are no security boundary (CPython's documentation says so: native code,
or a solution that reads this process's memory to forge its report, gets past them), the file system is the
user's (a fresh cwd, not a chroot), and there is no network namespace. Run untrusted code in a container.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time

PASS = "pass"
FILE_LIMIT = 64 << 20  # bytes a test may write to one file
_BLOCKED_EVENTS = ("socket.__new__", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.forkpty",
                   "subprocess.Popen", "pty.spawn")
_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(prctl=None, parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; nothing elsewhere), so nothing outlives
    the process that supervises it; exit at once if the parent is already gone."""
    prctl = prctl or _prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


class Blocked(RuntimeError):
    """What the guard raises in the solution's process instead of the refused operation."""


def _guard(max_forks: int, prctl) -> None:
    """The test process's audit hook and fork rules (module docstring). Irrevocable: an audit hook cannot be removed."""
    me = os.getpid()
    state = {"forks": 0, "trusted": False}

    def in_forked_child():
        state["trusted"] = True
        try:
            die_with_parent(prctl)
        finally:
            state["trusted"] = False

    def hook(event, args):
        if event in _BLOCKED_EVENTS:
            raise Blocked(f"blocked: {event.split('.')[0] if event.startswith('socket') else event}")
        if event.startswith("ctypes.") and not state["trusted"]:
            raise Blocked("blocked: ctypes")
        if event == "import" and args[0] in ("ctypes", "_ctypes") and not state["trusted"]:
            raise Blocked("blocked: ctypes")
        if event == "os.fork":
            if os.getpid() != me or state["forks"] >= max_forks:
                raise Blocked(f"blocked: fork (a test may fork {max_forks} processes, and they may not fork)")
            state["forks"] += 1

    for module in (os, sys.modules.get("posix")):
        for name in ("setsid", "setpgid", "setpgrp"):  # a process leaving the test's group would outlive its kill
            if hasattr(module, name):
                setattr(module, name, _refuse(name))
    os.register_at_fork(after_in_child=in_forked_child)
    sys.addaudithook(hook)


def _refuse(name):
    def refused(*args, **kwargs):
        raise Blocked(f"blocked: {name}")
    return refused


def _run_test(program: str, test: str, spec: dict, report: int, prctl, supervisor: int) -> None:
    """In the forked test process: limits, guard, the program, the test; one status line on `report`; never returns."""
    status = "crashed: no status"
    try:
        os.setpgid(0, 0)
        die_with_parent(prctl, supervisor)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        cpu = int(spec["test_s"]) + 1
        limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT)), (resource.RLIMIT_CORE, (0, 0))]
        if spec.get("memory_mb"):
            limits.append((resource.RLIMIT_AS, (spec["memory_mb"] << 20,) * 2))
        for which, value in limits:
            resource.setrlimit(which, value)
        _guard(int(spec.get("max_forks", 0)), prctl)
        namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
        exec(compile(program, "<solution>", "exec"), namespace)
        exec(compile(test, "<test>", "exec"), namespace)
        status = PASS
    except MemoryError:
        status = "out of memory"
    except Blocked as e:
        status = str(e)
    except BaseException as e:  # noqa: BLE001 - any failure of the solution or its test is the test's result
        status = type(e).__name__
    try:
        os.write(report, (status[:200] + "\n").encode())
    finally:
        os._exit(0)


def _died(status: int, test_s: float) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"timeout after {test_s:g} s (CPU)"
        if sig == signal.SIGXFSZ:
            return "crashed: file size limit"
        return f"crashed: {signal.Signals(sig).name}"
    return f"exited with code {os.WEXITSTATUS(status)} before the test finished"


def run_one(program: str, test: str, spec: dict, prctl) -> str:
    """Fork a test process, wait for its status at most `test_s` seconds, then kill its process group; the status."""
    test_s = float(spec["test_s"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _run_test(program, test, spec, w, prctl, supervisor=os.getppid())
    os.close(w)
    deadline = time.monotonic() + test_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            break
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    if b"\n" in data:
        return data.split(b"\n", 1)[0].decode(errors="replace")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and time.monotonic() >= deadline:
        return f"timeout after {test_s:g} s"
    return _died(status, test_s)


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    prctl = _prctl()
    die_with_parent(prctl, spec.get("parent"))
    for i, test in enumerate(spec["tests"]):
        status = run_one(spec["program"], test, spec, prctl)
        sys.stdout.write(json.dumps({"test": i, "status": status}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
