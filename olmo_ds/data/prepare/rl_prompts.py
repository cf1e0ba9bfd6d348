"""Sample RL prompts in the layout of the public RLVR mixes (`scripts/make_rl_prompts.py`), deterministic from a seed.

Three task families, each row `{"messages": [{"role": "user", ...}], "ground_truth": ..., "dataset": VERIFIER}`
as `prepare_data.py --format rl` reads them:

- arithmetic (`Arithmetic`, verifier `gsm8k`): "What is 3 + 4?" over an operand range and an operation, the
  ground truth the result as a string. A task a tiny model learns on a CPU in minutes, and the same questions as
  chat records for supervised fine-tuning first (`Arithmetic.chat`: the reply in one fixed format,
  `ANSWER_FORMAT`, whose last number is the answer, so GSM8K's scoring reads it under either of its rules);
- instruction following (`ifeval_rows`, verifier `ifeval`): a short request with one or two IFEval constraints
  (all lowercase, include a keyword, end with a phrase, no commas), the ground truth in open-instruct's
  layout `{"instruction_id": [...], "kwargs": [...]}`;
- math (`math_rows`, verifier `math`): the sum of two fractions, to be given in `\\boxed{}`, the ground truth
  in LaTeX (`\\frac{5}{6}`, or an integer);
- code (`code_rows`, verifier `code`): a small Python function to write (`CODE_TASKS`: sum of squares, vowel
  count, run-length encoding, ...), the ground truth three assert statements on drawn inputs (open-instruct's
  code layout), their expected values computed by the task's reference solution (`reference_solution`).

`bad_lines(max_tokens)`: one line per kind of input `--format rl` refuses (the fixture set's bad.jsonl).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
ANSWER_FORMAT = "The answer is {result}."


@dataclass(frozen=True)
class Arithmetic:
    """Questions "What is A OP B?" with A and B drawn from [low, high]."""

    low: int = 0
    high: int = 9
    operation: str = "+"
    answer_format: str = ANSWER_FORMAT

    def __post_init__(self):
        if self.operation not in OPERATIONS:
            raise ValueError(f"operation must be one of {', '.join(OPERATIONS)}, got {self.operation!r}")
        if self.low > self.high:
            raise ValueError(f"operand range [{self.low}, {self.high}] is empty: low must be <= high")
        if "{result}" not in self.answer_format:
            raise ValueError(f"answer format {self.answer_format!r} must hold {{result}}")

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return f"What is {a} {self.operation} {b}?", OPERATIONS[self.operation](a, b)

    def rows(self, n: int, seed: int) -> list[dict]:
        """`n` RLVR rows (verifier gsm8k)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            question, result = self._draw(rng)
            out.append({"messages": [{"role": "user", "content": question}], "ground_truth": str(result), "dataset": "gsm8k"})
        return out

    def chat(self, n: int, seed: int) -> list[dict]:
        """`n` chat records (user question, assistant answer in `answer_format`) for `prepare_data.py --format chat`;
        the same seed draws the same questions as `rows`."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            question, result = self._draw(rng)
            out.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": self.answer_format.format(result=result)}]})
        return out


_TOPICS = ["the sea", "a red bicycle", "autumn leaves", "a quiet library", "mountain trains", "morning coffee", "an old map", "city rain"]
_KEYWORDS = ["lantern", "harbor", "velvet", "compass", "meadow", "ember"]
_PHRASES = ["That is all.", "Any other questions?", "The end."]


def ifeval_rows(n: int, seed: int) -> list[dict]:
    """`n` instruction-following rows (verifier ifeval), one or two constraints each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic = rng.choice(_TOPICS)
        constraints = []
        kinds = rng.sample(["lowercase", "keyword", "end", "no_comma"], rng.randint(1, 2))
        for kind in kinds:
            if kind == "lowercase":
                constraints.append(("change_case:english_lowercase", None, "Your entire response should be in English, and in all lowercase letters."))
            elif kind == "keyword":
                word = rng.choice(_KEYWORDS)
                constraints.append(("keywords:existence", {"keywords": [word]}, f"Include the keyword \"{word}\" in your response."))
            elif kind == "end":
                phrase = rng.choice(_PHRASES)
                constraints.append(("startend:end_checker", {"end_phrase": phrase}, f"Finish your response with this exact phrase: {phrase}"))
            else:
                constraints.append(("punctuation:no_comma", None, "Do not use any commas in your response."))
        prompt = f"Write two sentences about {topic}. " + " ".join(text for _, _, text in constraints)
        out.append({"messages": [{"role": "user", "content": prompt}],
                    "ground_truth": {"instruction_id": [i for i, _, _ in constraints], "kwargs": [k for _, k, _ in constraints]},
                    "dataset": "ifeval"})
    return out


def _latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def math_rows(n: int, seed: int) -> list[dict]:
    """`n` math rows (verifier math): the sum of two unit-ish fractions, answered in \\boxed{}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = Fraction(rng.randint(1, 5), rng.randint(2, 9)), Fraction(rng.randint(1, 5), rng.randint(2, 9))
        question = (f"Compute $\\frac{{{a.numerator}}}{{{a.denominator}}} + \\frac{{{b.numerator}}}{{{b.denominator}}}$. "
                    "Simplify, and put your final answer in \\boxed{}.")
        out.append({"messages": [{"role": "user", "content": question}], "ground_truth": _latex(a + b), "dataset": "MATH"})
    return out


@dataclass(frozen=True)
class CodeTask:
    """A function to write: `request` asks for it, `solution` is a reference implementation, `draw` gives the
    arguments of one test."""

    function: str
    request: str
    solution: str
    draw: Callable[[random.Random], tuple]


def _ints(rng: random.Random, n_max: int = 6) -> list[int]:
    return [rng.randint(-9, 9) for _ in range(rng.randint(0, n_max))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeioustr") for _ in range(rng.randint(1, 9)))


CODE_TASKS = (
    CodeTask("sum_of_squares", "takes a list of integers and returns the sum of their squares",
             "def sum_of_squares(xs):\n    return sum(x * x for x in xs)\n", lambda rng: (_ints(rng),)),
    CodeTask("count_vowels", "takes a string and returns how many of its characters are vowels (a, e, i, o, u, lowercase only)",
             "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n", lambda rng: (_word(rng),)),
    CodeTask("second_largest", "takes a list of integers with at least two distinct values and returns the second largest distinct value",
             "def second_largest(xs):\n    return sorted(set(xs))[-2]\n", lambda rng: ((lambda xs: xs + rng.sample(xs, rng.randint(0, len(xs))))(rng.sample(range(-20, 21), rng.randint(2, 5))),)),
    CodeTask("run_length", "takes a string and returns its run-length encoding as a list of (character, count) tuples, e.g. "
             "run_length('aab') == [('a', 2), ('b', 1)]",
             "def run_length(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n            out[-1] = (c, out[-1][1] + 1)\n"
             "        else:\n            out.append((c, 1))\n    return out\n", lambda rng: ("".join(rng.choice("ab") for _ in range(rng.randint(0, 7))),)),
    CodeTask("is_palindrome", "takes a string and returns whether it reads the same backwards, ignoring case",
             "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]\n",
             lambda rng: ((lambda w: w + w[::-1] if rng.random() < 0.5 else w)(_word(rng)),)),
    CodeTask("nth_fibonacci", "takes n >= 0 and returns the n-th Fibonacci number (nth_fibonacci(0) == 0, nth_fibonacci(1) == 1)",
             "def nth_fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n", lambda rng: (rng.randint(0, 30),)),
)
CODE_TESTS = 3  # asserts per row


def _call(task: CodeTask, args: tuple):
    namespace: dict = {}
    exec(task.solution, namespace)  # our own reference solution, to compute the expected value
    return namespace[task.function](*args)


def code_rows(n: int, seed: int) -> list[dict]:
    """`n` code rows (verifier code): a function to write, and `CODE_TESTS` asserts on drawn inputs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.choice(CODE_TASKS)
        tests = []
        for _ in range(CODE_TESTS):
            args = task.draw(rng)
            call = f"{task.function}({', '.join(repr(a) for a in args)})"
            tests.append(f"assert {call} == {_call(task, args)!r}")
        prompt = (f"Write a Python function `{task.function}` that {task.request}. "
                  "Give the complete function in one ```python code block.")
        out.append({"messages": [{"role": "user", "content": prompt}], "ground_truth": tests, "dataset": "code"})
    return out


def reference_solution(row: dict) -> str:
    """The reference solution of a `code_rows` row, as a completion would give it (in a python block)."""
    (task,) = [t for t in CODE_TASKS if f"`{t.function}`" in row["messages"][-1]["content"]]
    return f"Here is the function:\n\n```python\n{task.solution}```\n"


def mixed_rows(n_arithmetic: int, n_ifeval: int, n_math: int, seed: int, arithmetic: Arithmetic = Arithmetic()) -> list[dict]:
    """The three families, interleaved by a seeded shuffle."""
    rows = arithmetic.rows(n_arithmetic, seed) + ifeval_rows(n_ifeval, seed + 1) + math_rows(n_math, seed + 2)
    random.Random(seed + 3).shuffle(rows)
    return rows


def bad_lines(max_tokens: int = 256) -> list[tuple[str, bytes]]:
    """(skip reason, line) for each kind of input `--format rl` refuses; the too-long prompt is longer than
    `max_tokens` tokens of any tokenizer (one token per word at least)."""
    user = [{"role": "user", "content": "What is 1 + 1?"}]

    def row(**kw) -> bytes:
        return json.dumps(kw).encode()

    return [
        ("malformed_json", b'{"messages": [{"role": "user", "content": "What is 1 + 1?"}], "ground_truth": "2", '),
        ("invalid_utf8", b'{"messages": [{"role": "user", "content": "caf\xe9"}], "ground_truth": "2", "dataset": "gsm8k"}'),
        ("not_an_object", b'["What is 1 + 1?", "2"]'),
        ("missing_messages", row(prompt="What is 1 + 1?", ground_truth="2", dataset="gsm8k")),
        ("missing_ground_truth", row(messages=user, dataset="gsm8k")),
        ("missing_verifier", row(messages=user, ground_truth="2")),
        ("unknown_verifier", row(messages=user, ground_truth="2", dataset="code_stdio")),
        ("bad_ground_truth", row(messages=user, ground_truth=["assert add(1, 1) == 2", "assert add(1,"], dataset="code")),
        ("bad_ground_truth", row(messages=user, ground_truth="two", dataset="gsm8k")),
        ("bad_ground_truth", row(messages=user, ground_truth={"instruction_id": ["keywords:existence"], "kwargs": [{}]}, dataset="ifeval")),
        ("bad_ground_truth", row(messages=user, ground_truth={"func_name": "validate_lowercase"}, dataset="ifeval")),
        ("not_ending_on_user", row(messages=user + [{"role": "assistant", "content": "2"}], ground_truth="2", dataset="gsm8k")),
        ("unknown_role", row(messages=[{"role": "teacher", "content": "What is 1 + 1?"}], ground_truth="2", dataset="gsm8k")),
        ("content_not_a_string", row(messages=[{"role": "user", "content": ["What is", "1 + 1?"]}], ground_truth="2", dataset="gsm8k")),
        ("empty_messages", row(messages=[], ground_truth="2", dataset="gsm8k")),
        ("prompt_too_long", row(messages=[{"role": "user", "content": "count: " + " ".join(str(i) for i in range(max_tokens))}],
                                ground_truth="2", dataset="gsm8k")),
    ]


def write_jsonl(path: Path, rows: list[dict]) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


FIXTURE_FILES = ("train.jsonl", "val.jsonl", "sft.jsonl", "code.jsonl", "bad.jsonl")


def write_fixtures(directory: Path, seed: int = 0, max_tokens: int = 256) -> dict[str, int]:
    """The test fixture set: train.jsonl (24 arithmetic, 8 ifeval, 4 math rows), val.jsonl (12 arithmetic),
    bad.jsonl (`bad_lines`, one per kind of refusal), sft.jsonl (24 arithmetic chat records), code.jsonl (8 code
    rows)."""
    directory = Path(directory)
    counts = {"train.jsonl": write_jsonl(directory / "train.jsonl", mixed_rows(24, 8, 4, seed)),
              "val.jsonl": write_jsonl(directory / "val.jsonl", Arithmetic().rows(12, seed + 100)),
              "sft.jsonl": write_jsonl(directory / "sft.jsonl", Arithmetic().chat(24, seed + 200)),
              "code.jsonl": write_jsonl(directory / "code.jsonl", code_rows(8, seed + 300))}
    lines = bad_lines(max_tokens)
    (directory / "bad.jsonl").write_bytes(b"".join(line + b"\n" for _, line in lines))
    counts["bad.jsonl"] = len(lines)
    return counts
