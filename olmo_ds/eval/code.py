"""The `code` verifier: a Python solution taken from a completion, run against its row's tests; the reward is the share
of tests passed.

The row, as open-instruct's CodeVerifier reads it (open_instruct/ground_truth_utils.py at e6c3044, lines 869-1013):
`ground_truth` is a list of test strings, each Python code that passes when it runs without raising (typically
`assert f(1) == 2`), or a JSON string holding such a list. `tests_of` refuses, before training, what cannot be run:
an empty list, a test that is not a string or does not compile, open-instruct's compressed form (base64 of a
zlib-compressed pickle, `decode_tests` in code_utils.py lines 52-88: unpickling data runs code, so it is refused),
and its stdin/stdout cases (`{"input", "output"}`, the `code_stdio` verifier's, not verified here).

The program (`extract_program`): the last fenced code block of the completion's answer part (`answer_part`: after
"</think>"), when the block is untagged or tagged python/py/python3; with no such block, the whole answer part.
open-instruct takes the last ``` block the same way (`extract_python_code`, lines 885-895: regex
"```(?:python)?(.*?)```", the whole output when there is none); a model that writes prose and then its solution in
a block is judged on the block, and code in a thinking section is a draft, not the answer. A block tagged with
another language is not taken for Python, and an unclosed block (a truncated sample) is not a block.

Running (`run_tests`): `olmo_ds/eval/code_harness.py` as a script in a fresh temporary directory, its own process
group, an emptied environment (no API keys reach the solution), killed whole when it is done or overdue; each test
in its own forked process with CPU-time, memory and wall-clock limits, no sockets and no other programs (that
module's docstring says what is guarded and what is not: it is no sandbox). The limits' defaults: `TEST_S`, 1 s
per test, open-instruct's `code_max_execution_time` (open_instruct/data_loader.py at e6c3044, line 470, which also
applies it per test: code_utils.py line 184); `MEMORY_MB`, 1 GiB of address space per test (open-instruct's
server sets none: `reliability_guard(None)`, code_utils.py lines 314-336); `MAX_FORKS`, 4 processes a test may
start (open-instruct refuses any program naming multiprocessing: `should_execute`, lines 271-286).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HARNESS = Path(__file__).with_name("code_harness.py")
TEST_S = 1.0
MEMORY_MB = 1024
MAX_FORKS = 4
STARTUP_S = 10.0  # the interpreter's start, allowed on top of the tests' time before the whole run is killed
_FENCE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "py", "python3")


def extract_program(answer: str) -> str:
    """The program of an answer part (module docstring): its last python (or untagged) fenced block, else all of it."""
    blocks = [body for tag, body in _FENCE.findall(answer) if tag.strip().lower() in _PYTHON_TAGS]
    return blocks[-1].strip() if blocks else answer.strip()


def tests_of(ground_truth) -> list[str]:
    """The tests of a code ground truth (module docstring); a ValueError saying what cannot be run."""
    tests = ground_truth
    if isinstance(tests, str):
        text = tests.strip()
        if not text:
            raise ValueError("the code ground truth is empty; it must be a list of Python test strings, e.g. [\"assert add(1, 2) == 3\"]")
        try:
            tests = json.loads(text)
        except ValueError:
            raise ValueError(f"the code ground truth is a string that is not a JSON list of tests: {text[:80]!r} (open-instruct's "
                             "compressed pickles are refused: unpickling runs code; write the tests as a list of strings)") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"a code ground truth is a non-empty list of Python test strings, got {type(tests).__name__} {str(tests)[:80]}")
    for i, test in enumerate(tests):
        if isinstance(test, dict) and {"input", "output"} <= set(test):
            raise ValueError(f"code test {i + 1} is a stdin/stdout case (open-instruct's code_stdio layout), which is not verified here; "
                             "write tests as Python statements, e.g. \"assert solve('1 2') == '3'\"")
        if not isinstance(test, str) or not test.strip():
            raise ValueError(f"code test {i + 1} must be a non-empty string of Python, got {test!r:.80}")
        try:
            compile(test, f"<test {i + 1}>", "exec")
        except (SyntaxError, ValueError) as e:
            raise ValueError(f"code test {i + 1} is not valid Python ({type(e).__name__}: {e}): {test[:80]!r}") from None
    return tests


def run_tests(program: str, tests: list[str], *, test_s: float = TEST_S, memory_mb: int = MEMORY_MB,
              max_forks: int = MAX_FORKS) -> list[str]:
    """Each test's status ("pass", or why not: "AssertionError", "timeout after 1 s", "out of memory", "blocked:
    socket", ...). Returns within len(tests) x (test_s + 0.5) + STARTUP_S seconds; raises RuntimeError when the
    harness itself fails."""
    spec = {"program": program, "tests": tests, "test_s": test_s, "memory_mb": memory_mb, "max_forks": max_forks, "parent": os.getpid()}
    deadline = time.monotonic() + len(tests) * (test_s + 0.5) + STARTUP_S
    with tempfile.TemporaryDirectory(prefix="olmo-ds-code-") as cwd:
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-I", str(HARNESS)], cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out = _collect(proc, json.dumps(spec).encode(), len(tests), deadline)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
    return out


def _collect(proc: subprocess.Popen, spec: bytes, n: int, deadline: float) -> list[str]:
    """The harness's status lines, read as they come until all `n` are in, it exits, or the deadline passes."""
    try:
        proc.stdin.write(spec)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    data, err = b"", b""
    streams = [proc.stdout, proc.stderr]
    while streams and data.count(b"\n") < n:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for stream in select.select(streams, [], [], left)[0]:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                streams.remove(stream)
            elif stream is proc.stdout:
                data += chunk
            else:
                err += chunk
    statuses = [json.loads(line)["status"] for line in data.splitlines()[:n]]
    if len(statuses) < n:
        why = "ran past its time limit" if time.monotonic() >= deadline else f"exited ({proc.poll()})"
        raise RuntimeError(f"the code harness {why} after {len(statuses)} of {n} tests: {err.decode(errors='replace')[-300:]}")
    return statuses


def score(answer: str, ground_truth, **limits) -> tuple[float, str | None]:
    """(share of tests passed, what failed: None when all passed) of an answer part against a code ground truth."""
    tests = tests_of(ground_truth)
    program = extract_program(answer)
    if not program:
        return 0.0, "no program in the answer"
    statuses = run_tests(program, tests, **limits)
    passed = sum(s == "pass" for s in statuses)
    failed = [(i, s) for i, s in enumerate(statuses) if s != "pass"]
    detail = None if not failed else f"{passed}/{len(tests)} tests passed; test {failed[0][0] + 1}: {failed[0][1]}"
    return passed / len(tests), detail
