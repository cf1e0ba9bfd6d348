"""Task readers: the real OLMES request files, the plain JSON-lines format, and every bad-input error."""

import gzip
import json

import pytest

from olmo_ds.eval.tasks import load_task, resolve_task

from eval_testlib import ARC_EASY, PIQA, SHARED


def test_olmes_piqa_and_arc_easy_read_as_published():
    piqa = load_task(PIQA)
    assert (piqa.name, piqa.primary_metric, len(piqa.questions)) == ("piqa", "acc_per_char", 1838)
    assert all(len(q.choices) == 2 and q.uncond is not None for q in piqa.questions)
    q = piqa.questions[0]
    assert q.choices[0] == ("Goal: How do I ready a guinea pig cage for it's new occupants?\nAnswer:", " Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, you will also need to supply it with a water bottle and a food dish.")
    assert q.gold == 0 and q.uncond[0][0] == "Answer:"

    arc = load_task(ARC_EASY)
    assert (arc.name, arc.primary_metric, len(arc.questions)) == ("arc_easy", "acc", 570)  # OLMES "acc_raw"
    assert sorted({len(q.choices) for q in arc.questions}) == [3, 4, 5]
    assert all(0 <= q.gold < len(q.choices) for q in arc.questions)
    assert arc.questions[0].choices[1] == ("Question: Which technology was developed most recently?\nAnswer:", " television")


def test_task_names_resolve_in_task_dirs():
    assert resolve_task("piqa_rc_0shot", [SHARED / "eval"]) == SHARED / "eval" / "piqa_rc_0shot"
    with pytest.raises(FileNotFoundError, match="no task of that name"):
        resolve_task("hellaswag_rc_0shot", [SHARED / "eval"])


def _plain(tmp_path, lines):
    path = tmp_path / "mytask.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plain_jsonl(tmp_path):
    path = _plain(tmp_path, [json.dumps({"context": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}), "", json.dumps({"context": "Sky:", "choices": [" blue", " green", " red"], "gold": 2})])
    task = load_task(path)
    assert (task.name, task.primary_metric, len(task.questions)) == ("mytask", "acc", 2)
    assert task.questions[1].choices == [("Sky:", " blue"), ("Sky:", " green"), ("Sky:", " red")]
    assert task.questions[1].where == f"{path}:3"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"context": "a", "choices": ["x", "y"], "gold": 2}', r"mytask.jsonl:2: gold index 2 is out of range for 2 choices"),
        ('{"context": "a", "choices": ["x", "y"], "gold": -1}', r"mytask.jsonl:2: gold index -1 is out of range"),
        ('{"context": "a", "choices": ["x", "y"], "gold": true}', r"mytask.jsonl:2: 'gold' must be int, got bool"),
        ('{"context": "a", "choices": ["x", "y"]}', r"mytask.jsonl:2: missing key 'gold'"),
        ('{"context": "a", "choices": ["x"], "gold": 0}', r"mytask.jsonl:2: 'choices' needs at least 2"),
        ('{"context": "a", "choices": ["x", 3], "gold": 0}', r"mytask.jsonl:2: choice 1 must be a non-empty string"),
        ('{"context": "a", "choices": ["x", "y"], "gold": 0', r"mytask.jsonl:2: malformed JSON"),
        ('["a", "b"]', r"mytask.jsonl:2: expected a JSON object"),
    ],
)
def test_plain_jsonl_errors_name_file_and_line(tmp_path, line, message):
    good = json.dumps({"context": "c", "choices": ["a", "b"], "gold": 1})
    with pytest.raises(ValueError, match=message):
        load_task(_plain(tmp_path, [good, line]))


def _olmes(tmp_path, records, primary="acc_per_char"):
    d = tmp_path / "task_rc"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"task_name": "t", "task_config": {"primary_metric": primary, "metric_kwargs": {"uncond_docid_offset": 1000}}}))
    with gzip.open(d / "requests.jsonl.gz", "wt") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return d


def _req(doc_id, idx, label, context="Q:", continuation=" a"):
    return {"request_type": "loglikelihood", "request": {"context": context, "continuation": continuation}, "doc_id": doc_id, "idx": idx, "label": label}


def test_olmes_errors(tmp_path):
    with pytest.raises(ValueError, match=r"requests.jsonl.gz:2: doc_id 0 has label 1 here but 0"):
        load_task(_olmes(tmp_path / "a", [_req(0, 0, 0), _req(0, 1, 1)]))
    with pytest.raises(ValueError, match=r"requests.jsonl.gz:1: gold index 2 is out of range for 2 choices"):
        load_task(_olmes(tmp_path / "b", [_req(0, 0, 2), _req(0, 1, 2)]))
    with pytest.raises(ValueError, match=r"doc_id 0 has choice indices \[0, 2\]"):
        load_task(_olmes(tmp_path / "c", [_req(0, 0, 0), _req(0, 2, 0)]))
    with pytest.raises(ValueError, match=r"requests.jsonl.gz:2: request_type 'generate_until'"):
        load_task(_olmes(tmp_path / "d", [_req(0, 0, 0), {**_req(0, 1, 0), "request_type": "generate_until"}]))
    with pytest.raises(ValueError, match=r"requests.jsonl.gz:1: malformed JSON"):
        load_task(_olmes(tmp_path / "e", ['{"request_type": ']))
    with pytest.raises(ValueError, match=r"primary_metric 'f1' is not a multiple-choice metric"):
        load_task(_olmes(tmp_path / "f", [_req(0, 0, 0), _req(0, 1, 0)], primary="f1"))
    (tmp_path / "g").mkdir()
    (tmp_path / "g").joinpath("requests.jsonl.gz").write_bytes(gzip.compress(json.dumps(_req(0, 0, 0)).encode()))
    with pytest.raises(FileNotFoundError, match=r"config.json: missing"):
        load_task(tmp_path / "g")


def test_olmes_unconditional_requests_attach_to_their_question(tmp_path):
    task = load_task(_olmes(tmp_path, [_req(0, 0, 1), _req(0, 1, 1, continuation=" b"), _req(1000, 0, 1, "Answer:"), _req(1000, 1, 1, "Answer:", " b")]))
    assert task.has_uncond and task.questions[0].uncond == [("Answer:", " a"), ("Answer:", " b")]
