"""The OLMES builder against oe-eval's own requests: HF-layout rows made of the shared arc_easy and
piqa dumps' `doc` fields rebuild those dumps' requests exactly (contexts, continuations, order, gold,
unconditional requests); and the formulations (MC letters, shots, winogrande's partial scoring)."""

import gzip
import json

import pytest

from olmo_ds.eval import olmes
from olmo_ds.eval.tasks import load_task

from eval_testlib import ARC_EASY, PIQA


def _docs(task_dir) -> list[dict]:
    """The `doc` of every conditional request's question, in doc_id order (one per question)."""
    docs = {}
    with gzip.open(task_dir / "requests.jsonl.gz", "rt") as f:
        for line in f:
            r = json.loads(line)
            docs.setdefault(r["doc_id"], r["doc"])
    return [docs[i] for i in sorted(docs) if i < 1_000_000]


def _arc_row(doc: dict) -> dict:
    """ai2_arc's layout (question, choices {text, label}, answerKey) from oe-eval's processed doc."""
    prefix, suffix = "Question: ", "\nAnswer:"
    assert doc["query"].startswith(prefix) and doc["query"].endswith(suffix)
    labels = list("ABCDE"[: len(doc["choices"])])
    return {"id": doc["id"], "question": doc["query"][len(prefix) : -len(suffix)],
            "choices": {"text": doc["choices"], "label": labels}, "answerKey": labels[doc["gold"]]}


def _piqa_row(doc: dict) -> dict:
    return {k: doc[k] for k in ("goal", "sol1", "sol2", "label")}


@pytest.mark.parametrize("name, shared, to_row", [("arc_easy", ARC_EASY, _arc_row), ("piqa", PIQA, _piqa_row)])
def test_builder_reproduces_oe_eval_requests(name, shared, to_row):
    published = load_task(shared)
    built = olmes.build_task(olmes.SUITE[name], [to_row(d) for d in _docs(shared)], "rc")
    assert len(built.questions) == len(published.questions) > 500
    for b, p in zip(built.questions, published.questions):
        assert (b.choices, b.gold, b.uncond) == (p.choices, p.gold, p.uncond), p.where


def test_mc_formulation_lists_letters_and_shots_precede_every_question():
    rows = [_arc_row(d) for d in _docs(ARC_EASY)[:3]]

    def listing(row):
        return f"Question: {row['question']}\n" + "".join(f" {l}. {t}\n" for l, t in zip(row["choices"]["label"], row["choices"]["text"])) + "Answer:"

    task = olmes.build_task(olmes.SUITE["arc_easy"], rows[2:], "mc", shots=rows[:2])
    q = task.questions[0]
    shots = "".join(f"{listing(r)} {r['answerKey']}\n\n" for r in rows[:2])
    letters = [f" {l}" for l in rows[2]["choices"]["label"]]
    assert q.choices == [(shots + listing(rows[2]), letter) for letter in letters]
    assert (task.name, task.primary_metric, q.uncond) == ("arc_easy_mc_2shot", "acc", None)


def test_winogrande_fills_the_blank_in_the_context():
    row = {"sentence": "The trophy didn't fit in the suitcase because the _ was too big.", "option1": "trophy", "option2": "suitcase", "answer": "1"}
    q = olmes.build_task(olmes.SUITE["winogrande"], [row], "rc").questions[0]
    assert q.choices == [("The trophy didn't fit in the suitcase because the trophy", " was too big."),
                         ("The trophy didn't fit in the suitcase because the suitcase", " was too big.")]
    assert q.gold == 0 and q.uncond is None


def test_a_row_of_another_layout_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"allenai/ai2_arc:test\[1\]: not a arc_easy row .*KeyError: 'choices'"):
        olmes.build_task(olmes.SUITE["arc_easy"], [_arc_row(_docs(ARC_EASY)[0]), {"goal": "x"}], "rc")
    with pytest.raises(ValueError, match="formulation 'cloze'"):
        olmes.build_task(olmes.SUITE["arc_easy"], [], "cloze")
