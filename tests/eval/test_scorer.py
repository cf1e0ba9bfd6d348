"""The scorer (olmo_ds/eval/scorer.py): verifiers in worker processes under a wall-clock and memory limit. A verifier
that hangs, crashes or eats memory (real ones, registered by this test and imported by the workers) scores 0 with
its reason while the rest of the batch is scored; results come in order, the same for any number of workers and
as `verifiers.reward` gives them in-process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from olmo_ds.eval import verifiers
from olmo_ds.eval.scorer import Scorer, score_all
from olmo_ds.eval.verifiers import Reward
from test_code_verifier import leaked_processes


def hang(completion, ground_truth):
    time.sleep(3600)


def segfault(completion, ground_truth):
    os.kill(os.getpid(), signal.SIGSEGV)


def exits(completion, ground_truth):
    os._exit(3)


def eat_memory(completion, ground_truth):
    chunks = []
    while True:
        chunks.append(bytearray(1 << 26))


def slow(completion, ground_truth):
    time.sleep(0.5)
    return 1.0


def length_check(ground_truth):
    if not isinstance(ground_truth, int):
        raise ValueError("a length is an int")


def length(completion, ground_truth):
    return float(len(completion) == ground_truth), f"length {len(completion)}"


FAULTY = {"hang": hang, "segfault": segfault, "exits": exits, "eat_memory": eat_memory, "slow": slow}
RIGHT, WRONG = ("gsm8k", "So the answer is 7.", "7"), ("gsm8k", "So the answer is 8.", "7")


@pytest.fixture(scope="module")
def registered():
    for name, fn in FAULTY.items():
        verifiers.register(name, fn)
    verifiers.register("length", length, length_check)
    yield
    for name in (*FAULTY, "length"):
        verifiers.unregister(name)


@pytest.fixture(scope="module")
def scorer(registered):
    with Scorer(workers=2, memory_mb=1024) as s:
        yield s


def test_a_hanging_verifier_times_out_and_the_batch_goes_on(scorer):
    items = [RIGHT, ("hang", "x", None), WRONG, ("hang", "y", None), RIGHT]
    replaced = scorer.replaced
    t0 = time.monotonic()
    got = scorer.score(items, timeout_s=0.5)
    assert got == [Reward(1.0), Reward(0.0, "timeout after 0.5 s"), Reward(0.0), Reward(0.0, "timeout after 0.5 s"), Reward(1.0)]
    assert time.monotonic() - t0 < 0.5 * 2 + 10  # two timeouts (one per worker at most) and two workers started anew
    assert scorer.replaced == replaced + 2


def test_a_code_run_past_the_limit_is_killed_with_everything_it_started(scorer):
    solution = "```python\nimport os, time\ndef f():\n    os.fork()\n    time.sleep(60)\n```"
    got = scorer.score([("code", solution, ["f()"] * 5), RIGHT], timeout_s=1.5)  # 5 tests of 1 s each: past 1.5 s
    assert got == [Reward(0.0, "timeout after 1.5 s"), Reward(1.0)]
    time.sleep(0.3)
    assert leaked_processes() == []


def test_an_interrupted_batch_leaves_no_stale_results_for_the_next(registered):
    """Ctrl-C (here a KeyboardInterrupt from a timer) while a worker is mid-chunk: it goes on scoring into its pipe, so
    the pool is restarted and the next batch gets its own results."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    with Scorer(workers=1) as scorer:
        scorer.score([RIGHT])
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            with pytest.raises(KeyboardInterrupt):
                scorer.score([("slow", "", None)] + [WRONG] * 4, timeout_s=30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        time.sleep(0.6)  # the worker has written the interrupted batch's results by now
        assert scorer.score([RIGHT] * 3, timeout_s=5) == [Reward(1.0)] * 3


def test_crashes_and_memory_are_reasons_not_failures_of_the_run(scorer):
    items = [("segfault", "", None), RIGHT, ("exits", "", None), ("eat_memory", "", None), WRONG, ("length", "abc", 3), ("length", "ab", 3)]
    got = scorer.score(items, timeout_s=20)
    assert got == [Reward(0.0, "crashed: SIGSEGV"), Reward(1.0), Reward(0.0, "crashed: exit code 3"), Reward(0.0, "out of memory"),
                   Reward(0.0), Reward(1.0, None, "length 3"), Reward(0.0, None, "length 2")]
    assert scorer.score([RIGHT] * 3, timeout_s=1) == [Reward(1.0)] * 3  # the replaced workers score again
    assert verifiers.check("LENGTH", 3) == "length"
    with pytest.raises(ValueError, match="a length is an int"):
        verifiers.check_ground_truth("length", "3")


def test_results_are_in_order_and_the_same_for_any_worker_count(registered):
    gt_if = {"instruction_id": ["keywords:existence"], "kwargs": [{"keywords": ["apple"]}]}
    items = []
    for i in range(40):
        items += [("gsm8k", f"So the answer is {i % 7}.", "3"), ("math", f"\\boxed{{{i % 3}}}", "1"), ("ifeval", ["pears", "apple pie"][i % 2], gt_if),
                  ("exact_match", "Paris" if i % 5 else "Rome", "Paris"), ("nope", "x", "y"), ("gsm8k", None, "7")]
    items += [("code", "```python\ndef f(x):\n    return x + 1\n```", ["assert f(1) == 2", "assert f(2) == 4"])]
    expected = [verifiers.reward(*item) for item in items]
    assert expected[-1] == Reward(0.5, None, "1/2 tests passed; test 2: AssertionError")
    assert {r.error.split(":")[0] for r in expected if r.error} == {"GroundTruthError", "TypeError"}
    for workers in (1, 3):
        with Scorer(workers=workers) as s:
            assert s.score(items, timeout_s=20) == expected
            assert s.score(items[::-1], timeout_s=20) == expected[::-1]
    assert score_all(items[:10], timeout_s=20) == expected[:10] and score_all([]) == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Scorer(workers=1).score([RIGHT], timeout_s=0)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Scorer(workers=-1)
    with pytest.raises(ValueError, match="memory_mb must be >= 256"):
        Scorer(memory_mb=10)
    with pytest.raises(ValueError, match="built in"):
        verifiers.register("GSM8K", length)
    verifiers.register("local", lambda completion, ground_truth: 1.0)
    try:
        with pytest.raises(ValueError, match="registered verifier 'local' cannot reach the scorer's workers: its functions must be module-level"):
            Scorer(workers=1).score([RIGHT])
    finally:
        verifiers.unregister("local")
