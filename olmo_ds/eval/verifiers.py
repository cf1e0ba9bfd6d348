"""Verifiers: one scoring of a completion against a ground truth, for evaluation and for RL rewards.

RL with verifiable rewards (GRPO, issue #52) reads prompts in the layout of the public RLVR mixes
(`{"messages": [...], "ground_truth": ..., "dataset": "gsm8k"}`, e.g. allenai/RLVR-GSM-MATH-IF-Mixed-Constraints):
the row's `dataset` names the verifier that scores a completion. open-instruct looks the name up lower-cased
(open_instruct/ground_truth_utils.py at e6c3044, `build_all_verifiers` line 1202, the per-row lookup line 1273);
so do we (`resolve`: case and surrounding spaces do not matter). The verifiers (`VERIFIERS`):

- `gsm8k`: a number answer, scored as our GSM8K task scores it: `olmo_ds.eval.gsm8k.extract(completion)` against
  `gsm8k.normalize(ground_truth)` (open-instruct's GSM8KVerifier, lines 199-221, takes the completion's last
  number; `gsm8k.extract` is the task's rule, one rule for evaluation and reward). The ground truth is a number
  or a string holding one ("18", "-3.5", "1,234").
- `math`: a LaTeX answer: the completion's last `\\boxed{...}` (or `\\fbox{...}`) against the ground truth (a
  LaTeX string without the box, as the MATH rows of the mixes carry it). With math-verify installed
  (`pip install olmo-ds[math]`) the two are compared for mathematical equivalence (`math_verify.verify`:
  "\\frac{1}{2}" equals "0.5"); without it, as normalised strings (`normalize_latex`: spaces, `\\left`/`\\right`,
  `\\!`/`\\,`, `\\dfrac`/`\\tfrac`, `^\\circ`, `\\%`, `$`, a trailing "." and `\\text{...}` wrappers removed), which
  accepts fewer equal answers but never a wrong one. A completion with no box scores 0 (open-instruct's
  MathVerifier, lines 224-278, tries more extractions; a box is the one answer format our prompts ask for).
- `ifeval`: instruction following: the fraction of the ground truth's instructions that the completion
  follows (strict, as IFEval's `inst_level_strict` counts one; open-instruct's IFEvalVerifier, lines 310-354,
  the reward OLMo 3's RLVR used), checked by `olmo_ds.eval.ifeval.CHECKS` on the completion's answer part
  (`answer_part`: after a "</think>", without "<answer>" tags, as that verifier reads it). The ground truth, in the layouts
  the mixes use: `{"instruction_id": [...], "kwargs": [...]}` (open-instruct's), `{"instruction_id_list": ...,
  "kwargs": ...}` (google/IFEval's), a list holding one such object, or any of those as a JSON string or a
  Python literal (RLVR-IFeval writes `"[{'instruction_id': [...], 'kwargs': [...]}]"`). The older
  `{"func_name": ...}` constraints (open-instruct's IFEvalVerifierOld) are refused, naming the layout to use.
- `exact_match`: the completion, stripped of surrounding whitespace, equals the ground truth string so stripped.
- `code`: a Python solution (the last python fenced block of the answer part, else the whole answer part) run
  against the row's tests (a list of Python test strings, typically asserts: open-instruct's CodeVerifier layout)
  in a subprocess with time, memory and network limits; the score is the share of tests passed, and
  `Reward.detail` names the first failure ("2/3 tests passed; test 3: timeout after 1 s"). `olmo_ds.eval.code`
  holds the rules, their sources and what the limits do and do not guard.

`register(name, score, check)` adds a verifier (a plugin's, or a test's); `resolve` then knows it by that name.

`check_ground_truth(verifier, ground_truth)` refuses, before any training, what no completion could be scored
against (data preparation calls it per row: `prepare_data.py --format rl`); `reward(verifier, completion,
ground_truth) -> Reward` never raises: a verifier that fails on a sample gives score 0.0 and the reason in
`Reward.error`, for the trainer to count. It runs in the calling process, with no time limit of its own beyond the
code verifier's and math-verify's (which works only on a main thread); `olmo_ds.eval.scorer.score_all` scores a
batch in worker processes under a wall-clock and memory limit, so that a verifier that hangs, crashes or eats
memory scores 0 with its reason instead of stalling or ending a run.
"""

from __future__ import annotations

import ast
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from olmo_ds.eval import code, gsm8k, ifeval

VERIFIERS = ("gsm8k", "math", "ifeval", "exact_match", "code")
# `dataset` values of the public RLVR mixes (and other spellings) -> the verifier; matched lower-cased.
ALIASES = {
    "gsm8k": "gsm8k",
    "math": "math",
    "ifeval": "ifeval",
    "exact_match": "exact_match",
    "exact": "exact_match",
    "code": "code",
}


OUT_OF_MEMORY = "out of memory"


class GroundTruthError(ValueError):
    """A row no completion could be scored against; `reason` is data preparation's skip key for it."""

    def __init__(self, message: str, reason: str = "bad_ground_truth"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Reward:
    score: float  # in [0, 1]
    error: str | None = None  # why the verifier could not score the completion (then score is 0.0)
    detail: str | None = None  # what a scored completion got wrong, where the verifier says (code: the first failed test)


def resolve(verifier) -> str:
    """The verifier a row's `dataset` value names (`ALIASES`, case-insensitive); a ValueError naming the known ones."""
    if not isinstance(verifier, str) or not verifier.strip():
        raise GroundTruthError(f"verifier (the row's 'dataset') must be a non-empty string, got {verifier!r}; known: {', '.join(VERIFIERS)}",
                               "unknown_verifier")
    key = verifier.strip().lower()
    name = ALIASES.get(key) or (key if key in _REGISTERED else None)
    if name is None:
        raise GroundTruthError(f"unknown verifier {verifier!r}; known: {', '.join((*VERIFIERS, *_REGISTERED))} (case-insensitive; aliases: "
                               f"{', '.join(a for a in ALIASES if a not in VERIFIERS)})", "unknown_verifier")
    return name


# --- gsm8k -------------------------------------------------------------------------------------------------------

_PLAIN_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _gsm8k_gold(ground_truth) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise ValueError(f"a gsm8k ground truth is a number or a string holding one, got {type(ground_truth).__name__} {ground_truth!r}")
    if isinstance(ground_truth, float) and not math.isfinite(ground_truth):
        raise ValueError(f"a gsm8k ground truth must be a finite number, got {ground_truth!r}")
    text = str(ground_truth).strip()
    if not text:
        raise ValueError("the gsm8k ground truth is empty; it must be the answer's number, e.g. \"18\"")
    gold = gsm8k.normalize(text)
    if not _PLAIN_NUMBER.fullmatch(gold):
        raise ValueError(f"the gsm8k ground truth {ground_truth!r} is not a number (e.g. \"18\", \"-3.5\", \"1,234\")")
    return gold


def _gsm8k(completion: str, ground_truth) -> float:
    return float(gsm8k.extract(completion) == _gsm8k_gold(ground_truth))


# --- math --------------------------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text`, braces balanced; None when there is none
    or it is not closed."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize_latex(answer: str) -> str:
    """The fallback's comparison form of a LaTeX answer (see the module docstring)."""
    s = _TEXT_WRAPPER.sub(r"\1", answer)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("$", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _math_gold(ground_truth) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise ValueError(f"a math ground truth is a LaTeX string (or a number), got {type(ground_truth).__name__} {ground_truth!r}")
    text = str(ground_truth).strip()
    if not text or not normalize_latex(text):
        raise ValueError("the math ground truth is empty; it must be the answer in LaTeX, e.g. \"\\frac{1}{2}\"")
    return last_boxed(text) or text  # a gold written boxed is the same answer


def _math(completion: str, ground_truth) -> float:
    gold = _math_gold(ground_truth)
    answer = last_boxed(completion)
    if answer is None or not answer.strip():
        return 0.0
    if normalize_latex(answer) == normalize_latex(gold):
        return 1.0
    if not math_verify_available():
        return 0.0
    from math_verify import parse, verify
    # math-verify's timeouts use signal.alarm, which only the main thread may set: elsewhere it runs without one.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    boxed = (lambda s: parse("\\boxed{" + s + "}", parsing_timeout=limit))
    return float(verify(boxed(gold), boxed(answer), timeout_seconds=limit))


# --- ifeval ------------------------------------------------------------------------------------------------------


def ifeval_instructions(ground_truth) -> list[tuple[str, dict]]:
    """[(instruction id, kwargs)] of an IFEval ground truth in any layout of the module docstring; a ValueError
    saying what is malformed."""
    gt = ground_truth
    if isinstance(gt, str):
        text = gt.strip()
        if not text:
            raise ValueError("the ifeval ground truth is empty; it must hold 'instruction_id' and 'kwargs' lists")
        try:
            gt = json.loads(text)
        except ValueError:
            try:
                gt = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                raise ValueError(f"the ifeval ground truth is a string that is neither JSON nor a Python literal: {text[:80]!r}") from None
        if isinstance(gt, str):  # a JSON string inside a list's string, as open-instruct unwraps it
            return ifeval_instructions(gt)
    if isinstance(gt, list):
        if len(gt) != 1:
            raise ValueError(f"an ifeval ground truth list must hold one constraint object, got {len(gt)} items")
        return ifeval_instructions(gt[0])
    if not isinstance(gt, dict):
        raise ValueError(f"an ifeval ground truth is an object with 'instruction_id' and 'kwargs' lists, got {type(gt).__name__}")
    if "func_name" in gt:
        raise ValueError(f"ifeval constraint {gt.get('func_name')!r} is in the older 'func_name' layout, which is not verified here; write "
                         "{\"instruction_id\": [IFEval instruction ids], \"kwargs\": [their arguments]}")
    ids_key = "instruction_id" if "instruction_id" in gt else "instruction_id_list"
    return ifeval.check_instructions(gt.get(ids_key), gt.get("kwargs"), "ifeval ground truth", ids_key=ids_key)


def answer_part(completion: str) -> str:
    """What an instruction-following completion answers with: the text after its last "</think>", "<answer>" tags
    removed, stripped (open-instruct's remove_thinking_section, ground_truth_utils.py lines 190-196), so a model that
    thinks first is judged on its answer, not on its reasoning."""
    return completion.split("</think>")[-1].replace("<answer>", "").replace("</answer>", "").strip()


def _ifeval(completion: str, ground_truth) -> float:
    instructions = ifeval_instructions(ground_truth)
    answer = answer_part(completion)
    if not answer:
        return 0.0
    followed = ifeval.score(answer, instructions)["strict"]
    return sum(followed) / len(followed)


# --- exact_match -------------------------------------------------------------------------------------------------


def _exact_gold(ground_truth) -> str:
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"an exact_match ground truth is a non-empty string, got {ground_truth!r}")
    return ground_truth.strip()


def _exact_match(completion: str, ground_truth) -> float:
    return float(completion.strip() == _exact_gold(ground_truth))


# --- code --------------------------------------------------------------------------------------------------------


def _code(completion: str, ground_truth) -> tuple[float, str | None]:
    return code.score(answer_part(completion), ground_truth)


_GOLD = {"gsm8k": _gsm8k_gold, "math": _math_gold, "ifeval": ifeval_instructions, "exact_match": _exact_gold, "code": code.tests_of}
_SCORE = {"gsm8k": _gsm8k, "math": _math, "ifeval": _ifeval, "exact_match": _exact_match, "code": _code}
_REGISTERED: dict[str, tuple[Callable, Callable | None]] = {}


def register(name: str, score: Callable[[str, Any], float | tuple[float, str | None]], check: Callable[[Any], Any] | None = None) -> None:
    """Add verifier `name` (matched lower-cased): `score(completion, ground_truth)` gives a score in [0, 1] (or
    (score, detail)), `check(ground_truth)` raises a ValueError for a ground truth it cannot score against. The
    scorer's workers (`olmo_ds.eval.scorer`) import both by module and name: they must be module-level functions."""
    key = name.strip().lower()
    if key in ALIASES:
        raise ValueError(f"verifier {name!r} is built in; register another name")
    _REGISTERED[key] = (score, check)


def unregister(name: str) -> None:
    _REGISTERED.pop(name.strip().lower(), None)


def registered() -> dict[str, tuple[Callable, Callable | None]]:
    """The verifiers `register` added, by name."""
    return dict(_REGISTERED)


def check(verifier, ground_truth) -> str:
    """`check_ground_truth`, returning the verifier's name (`resolve`); what `prepare_data.py --format rl` calls per
    row. Raises `GroundTruthError` (a ValueError) whose `reason` is the row's skip key: `unknown_verifier`,
    `missing_ground_truth` or `bad_ground_truth`."""
    name = resolve(verifier)
    if ground_truth is None:
        raise GroundTruthError(f"no ground truth: a {name} row needs a non-null 'ground_truth'", "missing_ground_truth")
    gold = _REGISTERED[name][1] if name in _REGISTERED else _GOLD[name]
    try:
        if gold is not None:
            gold(ground_truth)
    except ValueError as e:
        raise GroundTruthError(str(e)) from None
    return name


def check_ground_truth(verifier: str, ground_truth) -> None:
    """Raise a ValueError with the reason when `verifier` is unknown or `ground_truth` is one it cannot score
    against (missing or empty, a non-number GSM8K answer, a malformed IFEval constraint, ...)."""
    check(verifier, ground_truth)


def reward(verifier: str, completion: str, ground_truth) -> Reward:
    """The completion's score in [0, 1] by `verifier`; never raises: any failure is score 0.0 with the reason
    ("ExceptionClass: message", at most 200 characters; a MemoryError is "out of memory") in `error`."""
    try:
        name = resolve(verifier)
        if not isinstance(completion, str):
            raise TypeError(f"the completion is a {type(completion).__name__}, not a string")
        got = (_REGISTERED[name][0] if name in _REGISTERED else _SCORE[name])(completion, ground_truth)
        score, detail = got if isinstance(got, tuple) else (got, None)
        score = float(score)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"{name} scored {score}, outside [0, 1]")
        return Reward(score, None, detail)
    except MemoryError:
        return Reward(0.0, OUT_OF_MEMORY)
    except Exception as e:  # noqa: BLE001 - a reward must never end a run: the reason is counted instead
        return Reward(0.0, f"{type(e).__name__}: {e}"[:200])
