"""The code verifier (olmo_ds/eval/code.py, code_harness.py): a real Python solution run against real assert tests in
subprocesses, passing, failing, partly passing, and each kind of misbehaviour (a hang, forks, a memory hog, a crash,
a network attempt) bounded in time and scored as a failed test, with nothing left running."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from olmo_ds.eval import code
from olmo_ds.eval.verifiers import Reward, check_ground_truth, reward

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


def block(program: str, tag: str = "python") -> str:
    return f"Here it is:\n\n```{tag}\n{program}```\nThat adds them."


def _harness_processes() -> dict[int, tuple[int, int]]:
    """{pid: (parent, session)} of the live processes running the code harness or forked from it."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"code_harness.py" not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                ppid, _, sid = f.read().rsplit(")", 1)[1].split()[1:4]
            found[int(entry)] = (int(ppid), int(sid))
        except (OSError, ValueError):
            pass
    return found


def leaked_processes() -> list[int]:
    """Code-harness processes that nothing will end: one whose run (its session, led by the harness) is over, or a
    harness whose caller is gone. Other tests' runs in progress (pytest-xdist) are not counted."""
    procs = _harness_processes()
    return [pid for pid, (ppid, sid) in procs.items() if sid not in procs or (pid == sid and ppid == 1)]


@pytest.fixture(autouse=True)
def nothing_left_running():
    yield
    time.sleep(0.3)  # a killed process group is reaped a moment later
    assert leaked_processes() == []


def test_passing_failing_and_partly_passing_solutions():
    assert reward("code", block(ADD), TESTS) == Reward(1.0)
    assert reward("code", block("def add(a, b):\n    return a - b\n"), TESTS) == Reward(0.0, None, "0/3 tests passed; test 1: AssertionError")
    partly = reward("code", block("def add(a, b):\n    return int(a) + int(b)\n"), TESTS)
    assert partly == Reward(2 / 3, None, "2/3 tests passed; test 3: ValueError")
    assert reward("code", block(ADD), '["assert add(1, 2) == 3", "assert add(1, 2) == 4"]').score == 0.5  # a JSON string of tests


def test_each_test_runs_in_a_fresh_process_after_the_program():
    # Module state set by one test is not seen by the next (open-instruct runs each test in its own process).
    program = "seen = []\ndef note(x):\n    seen.append(x)\n    return len(seen)\n"
    assert reward("code", block(program), ["assert note(1) == 1", "assert note(2) == 1"]).score == 1.0
    # A solution's main block does not run (it would wait for input); its output goes nowhere.
    assert reward("code", block(ADD + "if __name__ == '__main__':\n    add(input(), 1)\nprint('x' * 100000)\n"), TESTS).score == 1.0


def test_the_program_is_the_last_python_block_else_the_whole_answer():
    assert code.extract_program(block("x = 1\n") + block(ADD)) == ADD.strip()
    assert code.extract_program(block(ADD) + block("SELECT 1;\n", "sql")) == ADD.strip()
    assert code.extract_program(block(ADD, "")) == ADD.strip()
    assert code.extract_program(ADD) == ADD.strip()
    assert code.extract_program("```python\ndef add(a, b):\n    return a +") == "```python\ndef add(a, b):\n    return a +"  # unclosed
    # Code in a thinking section is a draft: the answer part is judged.
    assert reward("code", "<think>```python\n" + ADD + "```</think>No code here.", TESTS).score == 0.0
    assert reward("code", "<think>draft</think>" + block(ADD), TESTS).score == 1.0
    assert reward("code", "", TESTS) == Reward(0.0, None, "no program in the answer")


def test_an_infinite_loop_times_out_per_test():
    t0 = time.monotonic()
    r = reward("code", block(ADD + "def spin():\n    while True:\n        pass\n"), ["spin()", "assert add(1, 2) == 3"])
    assert r == Reward(0.5, None, "1/2 tests passed; test 1: timeout after 1 s")
    assert time.monotonic() - t0 < 1 + 3


def test_a_hang_in_c_code_and_a_sleep_are_killed():
    statuses = code.run_tests(ADD, ["sum(range(10 ** 12))", "import time; time.sleep(60)", "assert add(1, 2) == 3"], test_s=0.5)
    assert statuses == ["timeout after 0.5 s", "timeout after 0.5 s", "pass"]


def test_forks_are_bounded_and_killed_with_the_test():
    # Each test process may fork MAX_FORKS children, which may not fork; all of them die with the test's process group.
    bomb = ("import os, time\ndef bomb():\n    made = 0\n    for _ in range(50):\n        try:\n            if os.fork() == 0:\n"
            "                try:\n                    os.fork()\n                except Exception:\n                    pass\n"
            "                time.sleep(60)\n            made += 1\n        except Exception:\n            pass\n    return made\n")
    t0 = time.monotonic()
    assert code.run_tests(bomb, [f"assert bomb() == {code.MAX_FORKS}", "bomb(); time.sleep(60)"], test_s=1.0) == ["pass", "timeout after 1 s"]
    assert time.monotonic() - t0 < 2 + 3
    # (the fixture checks that no process is left)


def test_a_memory_hog_is_stopped_at_its_limit():
    hog = "def hog():\n    chunks = []\n    while True:\n        chunks.append(bytearray(10 ** 7))\n"
    assert code.run_tests(hog, ["hog()", "x = bytearray(10 ** 10)"], memory_mb=256) == ["out of memory", "out of memory"]


def test_crashes_and_exits_fail_the_test_and_cannot_fake_a_pass():
    statuses = code.run_tests(ADD, ["import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "import os; os._exit(0)",
                                    "import sys; sys.exit(0)", "raise KeyboardInterrupt", "assert add(2, 2) == 4"])
    assert statuses == ["crashed: SIGSEGV", "exited with code 0 before the test finished", "SystemExit", "KeyboardInterrupt", "pass"]


def test_no_network_and_no_other_programs():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    tests = [f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
             f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
             "import os; os.system('true')", "import subprocess; subprocess.run(['true'])",
             "import ctypes; ctypes.CDLL(None).getpid()", "import os; os.setsid()"]
    statuses = code.run_tests("", tests)
    assert statuses == ["blocked: socket", "blocked: socket", "blocked: os.system", "blocked: subprocess.Popen", "blocked: ctypes",
                        "blocked: setsid"]
    time.sleep(0.1)
    server.close()
    assert accepted in ([], [None])  # nothing connected


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_runs_in_a_fresh_directory_with_an_emptied_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_DS_SECRET", "token")
    monkeypatch.chdir(tmp_path)
    tests = ["import os; assert os.listdir('.') == []", "open('out.txt', 'w').write('x')", "import os; assert 'OLMO_DS_SECRET' not in os.environ"]
    assert code.run_tests("", tests) == ["pass", "pass", "pass"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("gt, said", [
    ([], "non-empty list"),
    ("", "empty"),
    ("eJxrYJ0qxQABPUIMDAA=", "not a JSON list"),
    ([{"input": "1\n", "output": "2\n"}], "code_stdio layout"),
    (["assert f(1) == 2", 3], "test 2 must be a non-empty string"),
    (["assert f(1) =="], "test 1 is not valid Python"),
    ({"tests": ["assert 1"]}, "non-empty list"),
])
def test_ground_truths_that_cannot_be_run_are_refused(gt, said):
    with pytest.raises(ValueError) as e:
        check_ground_truth("code", gt)
    assert said in str(e.value)
    assert reward("code", block(ADD), gt).error.startswith("ValueError: ")
