"""Verifiers (olmo_ds/eval/verifiers.py): each kind right and wrong, refusals of ground truths, and a verifier that
fails on a sample giving reward 0 with the reason."""

import json

import pytest

from olmo_ds.eval import verifiers
from olmo_ds.eval.verifiers import Reward, check_ground_truth, reward

# Completions whose answer both GSM8K rules agree on ("So the answer is N" and the last number).
RIGHT, WRONG = "3 + 4 = 7. So the answer is 7.", "3 + 4 = 8. So the answer is 8."


@pytest.mark.parametrize("name", ["gsm8k", "GSM8K", " Gsm8k "])
def test_gsm8k_aliases_score_number_answers(name):
    assert reward(name, RIGHT, "7") == Reward(1.0)
    assert reward(name, WRONG, "7") == Reward(0.0)
    assert reward(name, "So the answer is 1,234.", 1234).score == 1.0
    assert reward(name, "So the answer is $18.", "18").score == 1.0
    # As the GSM8K task scores it (oe-eval's exact match, and open-instruct's verifier): "18.00" is not "18".
    assert reward(name, "So the answer is 18.00", "18").score == 0.0
    assert reward(name, "I do not know.", "7") == Reward(0.0)


def test_math_boxed_answers():
    assert reward("MATH", "so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}").score == 1.0
    assert reward("math", "\\boxed{\\dfrac{1}{2}}", "\\frac12".replace("12", "{1}{2}")).score == 1.0
    assert reward("math", "the answer is \\boxed{\\left( 3, 4 \\right)}", "(3,4)").score == 1.0
    assert reward("math", "\\boxed{3} then \\boxed{5}", "5").score == 1.0  # the last box counts
    assert reward("math", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == Reward(0.0)
    assert reward("math", "the answer is 1/2", "\\frac{1}{2}") == Reward(0.0)  # no box: no answer
    assert reward("math", "\\boxed{\\frac{1}{2}", "\\frac{1}{2}") == Reward(0.0)  # never closed


def test_math_equivalence_with_math_verify():
    pytest.importorskip("math_verify")
    assert reward("math", "\\boxed{0.5}", "\\frac{1}{2}").score == 1.0
    assert reward("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}").score == 1.0
    assert reward("math", "\\boxed{0.6}", "\\frac{1}{2}").score == 0.0


def test_math_without_math_verify_compares_normalised_strings(monkeypatch):
    monkeypatch.setattr(verifiers, "math_verify_available", lambda: False)
    assert reward("math", "\\boxed{ \\dfrac{1}{2} }", "\\frac{1}{2}").score == 1.0
    assert reward("math", "\\boxed{90^\\circ}", "90").score == 1.0
    assert reward("math", "\\boxed{\\text{(A)}}", "(A)").score == 1.0
    assert reward("math", "\\boxed{0.5}", "\\frac{1}{2}") == Reward(0.0)  # equal, but only math-verify knows it


def test_last_boxed_balances_braces():
    assert verifiers.last_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}"
    assert verifiers.last_boxed("\\fbox{7}") == "7"
    assert verifiers.last_boxed("no box") is None


IFEVAL_GT = {"instruction_id": ["change_case:english_lowercase", "keywords:existence", "startend:end_checker"],
             "kwargs": [None, {"keywords": ["apple"]}, {"end_phrase": "That is all."}]}


@pytest.mark.parametrize("layout", [
    lambda gt: gt,
    lambda gt: json.dumps(gt),
    lambda gt: [gt],
    lambda gt: str([gt]),  # RLVR-IFeval's Python-literal string
    lambda gt: json.dumps([json.dumps(gt)]),
    lambda gt: {"instruction_id_list": gt["instruction_id"], "kwargs": gt["kwargs"]},
])
def test_ifeval_fraction_of_instructions(layout):
    gt = layout(IFEVAL_GT)
    assert reward("IFEval", "i like apple pie. that is all.", gt) == Reward(1.0)
    assert reward("ifeval", "I like apple pie. That is all.", gt).score == pytest.approx(2 / 3)  # not lowercase
    assert reward("ifeval", "I like pears.", gt).score == 0.0
    assert reward("ifeval", "   ", gt) == Reward(0.0)


def test_ifeval_judges_the_answer_after_a_thinking_section():
    gt = {"instruction_id": ["change_case:english_lowercase"], "kwargs": [None]}
    assert reward("ifeval", "<think>The User Wants Lowercase.</think>\n<answer>this answer is written in english.</answer>", gt) == Reward(1.0)
    assert reward("ifeval", "<think>ok</think>All Done.", gt) == Reward(0.0)
    assert reward("ifeval", "<think>only thoughts</think>  ", gt) == Reward(0.0)


def test_lowercase_and_capitals_must_be_english_as_olmo3s_reward_reads_them():
    """open-instruct's IFEvalG rule (islower/isupper and langdetect's "en"), not only the case of the letters."""
    lower = {"instruction_id": ["change_case:english_lowercase"], "kwargs": [None]}
    upper = {"instruction_id": ["change_case:english_capital"], "kwargs": [None]}
    english, french = "the weather is lovely today and we walk by the sea.", "le temps est magnifique aujourd'hui et nous marchons au bord de la mer."
    assert reward("ifeval", english, lower) == Reward(1.0)
    assert reward("ifeval", french, lower) == Reward(0.0)
    assert reward("ifeval", english.upper(), upper) == Reward(1.0)
    assert reward("ifeval", french.upper(), upper) == Reward(0.0)
    assert reward("ifeval", "123 456.", lower) == Reward(0.0)  # no letters: not lowercase (islower)
    # langdetect is seeded: a short text's verdict (right or wrong) is the same every time.
    assert len({reward("ifeval", "all done here.", lower) for _ in range(5)}) == 1


def test_exact_match():
    assert reward("exact_match", "  Paris\n", "Paris") == Reward(1.0)
    assert reward("exact_match", "paris", "Paris") == Reward(0.0)


@pytest.mark.parametrize("verifier, gt, said", [
    ("sat_solver", "1", "unknown verifier 'sat_solver'; known: gsm8k, math, ifeval, exact_match, code"),
    ("", "1", "non-empty string"),
    (None, "1", "non-empty string"),
    ("gsm8k", None, "no ground truth"),
    ("gsm8k", "", "empty"),
    ("gsm8k", "seven", "not a number"),
    ("gsm8k", True, "is a number or a string"),
    ("gsm8k", [7], "is a number or a string"),
    ("math", "  ", "empty"),
    ("math", {"a": 1}, "LaTeX string"),
    ("ifeval", "", "empty"),
    ("ifeval", "{not json", "neither JSON nor a Python literal"),
    ("ifeval", {"instruction_id": ["no:such_check"], "kwargs": [{}]}, "'no:such_check' is not one this evaluation verifies"),
    ("ifeval", {"instruction_id": ["keywords:existence"], "kwargs": [{}]}, "missing ['keywords']"),
    ("ifeval", {"instruction_id": ["keywords:existence"], "kwargs": []}, "as many objects"),
    ("ifeval", {"instruction_id": ["length_constraints:number_words"], "kwargs": [{"num_words": 5, "relation": "about"}]},
     "relation must be one of"),
    ("ifeval", {"func_name": "validate_lowercase"}, "older 'func_name' layout"),
    ("ifeval", [IFEVAL_GT, IFEVAL_GT], "one constraint object"),
    ("exact_match", 3, "non-empty string"),
])
def test_check_ground_truth_refusals(verifier, gt, said):
    with pytest.raises(ValueError, match=None) as e:
        check_ground_truth(verifier, gt)
    assert said in str(e.value)


def test_check_names_the_skip_reason_data_preparation_counts():
    for verifier, gt, reason in [("nope", "1", "unknown_verifier"), ("gsm8k", None, "missing_ground_truth"), ("gsm8k", "x", "bad_ground_truth"),
                                 ("ifeval", {"func_name": "f"}, "bad_ground_truth")]:
        with pytest.raises(verifiers.GroundTruthError) as e:
            verifiers.check(verifier, gt)
        assert e.value.reason == reason and isinstance(e.value, ValueError)


def test_check_ground_truth_accepts_and_names():
    for verifier, gt in [("gsm8k", "18"), ("GSM8K", 18), ("math", "\\frac{1}{2}"), ("ifeval", IFEVAL_GT), ("exact_match", "Paris"),
                         ("code", ["assert f(1) == 2"]), ("Code", '["assert f(1) == 2"]')]:
        assert check_ground_truth(verifier, gt) is None
    assert verifiers.check("MATH", "1") == "math"


def test_a_failing_verifier_gives_zero_and_the_reason():
    bad = reward("ifeval", "anything", {"instruction_id": ["keywords:existence"], "kwargs": [{}]})
    assert bad.score == 0.0 and bad.error.startswith("ValueError: ") and "missing ['keywords']" in bad.error
    assert reward("nope", "x", "y").error.startswith("GroundTruthError: unknown verifier 'nope'")
    assert reward("gsm8k", None, "7").error.startswith("TypeError: ")
    assert reward("gsm8k", RIGHT, "seven").error.startswith("ValueError: ")
    assert len(reward("ifeval", "x", "{" * 500).error) <= 200
    assert reward("code", "```python\nx = 1\n```", "not json").error.startswith("ValueError: the code ground truth is a string that is not")
    assert all(r.error is None for r in (reward("gsm8k", RIGHT, "7"), reward("gsm8k", WRONG, "7")))
