"""The olmes-core suite from an offline Hugging Face cache laid out as `hf download` leaves the datasets'
parquet conversions (parquet files written here): every task in both formulations with its curated shots,
one error naming every fetch command when datasets are missing, OLMES's subsamples, the suite's table,
and `eval.sh --tasks olmes-core` end to end on a tiny model."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from eval_testlib import NEOX, export_hf, tiny_olmo
from olmo_ds import hub
from olmo_ds.eval import olmes, olmes_suite
from olmo_ds.eval import results as res
from olmo_ds.eval.olmes_shots import SHOTS
from testdata import fill_hf_cache

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # optional (pip install -e '.[parquet]'): the tests that write parquet files skip
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pq is None, reason="pyarrow is not installed (pip install -e '.[parquet]')")

REPO = Path(__file__).resolve().parents[2]
SUBJECTS = ("astronomy", "college_biology")


def _mmlu_row(subject: str, n: int) -> dict:
    return {"question": f"{subject} question {n}?", "subject": subject, "choices": [f"answer {n}{c}" for c in "abcd"], "answer": n % 4}


def _rows(spec: olmes.OlmesTask, split: str) -> list[dict]:
    """Rows in the dataset's layout: for the curated tasks their own shots, for MMLU made up per subject."""
    if spec.name != "mmlu":
        return SHOTS[spec.name][:3]
    return [_mmlu_row(s, n) for s in SUBJECTS for n in range(5 if split == "dev" else 2)]


def _parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def fill_olmes_cache(cache: Path, names=None) -> None:
    for spec in olmes.SUITE.values():
        if names is not None and spec.name not in names:
            continue
        files = {f"{spec.config}/{split}/0000.parquet": _parquet(_rows(spec, split)) for split in olmes_suite.splits(spec)}
        # ai2_arc holds two tasks: its second fill adds to the same snapshot
        commit = hashlib.sha1(spec.repo.encode()).hexdigest()
        fill_hf_cache(cache, spec.repo, files, commit=commit, ref=olmes_suite.REVISION, repo_type="dataset")


@needs_pyarrow
def test_every_task_in_both_formulations_offline_from_the_cache(hf_cache):
    fill_olmes_cache(hf_cache)
    tasks = {t.name: t for t in olmes_suite.load_suite()}
    expected = {f"{name}_{f}_5shot" for name in olmes.SUITE if name != "mmlu" for f in olmes.FORMULATIONS}
    expected |= {f"mmlu_{s}_{f}_5shot" for s in SUBJECTS for f in olmes.FORMULATIONS}
    assert set(tasks) == expected

    arc = tasks["arc_challenge_rc_5shot"]
    assert (arc.primary_metric, len(arc.questions), arc.config["revision"], arc.config["suite"]) == ("acc_uncond", 3, "refs/convert/parquet", "olmes-core")
    assert len(arc.config["commit"]) == 40 and arc.config["olmes"] == {"task": "arc_challenge", "formulation": "rc", "shots": 5}
    # the curated shots precede every question, solved; the question itself follows
    first = olmes.build_task(olmes.SUITE["arc_challenge"], SHOTS["arc_challenge"][:1], "rc").questions[0]
    context, gold = first.choices[first.gold]
    assert arc.questions[1].choices[0][0].startswith(f"{context}{gold}\n\n")
    assert arc.questions[1].choices[0][0].endswith(f"\n\n{olmes.build_task(olmes.SUITE['arc_challenge'], SHOTS['arc_challenge'][1:2], 'rc').questions[0].choices[0][0]}")
    assert tasks["boolq_mc_5shot"].primary_metric == "acc" and tasks["hellaswag_rc_5shot"].primary_metric == "acc_per_char"

    # MMLU: per subject, its line first, then its first 5 dev rows
    astro = tasks["mmlu_astronomy_mc_5shot"]
    assert astro.config["olmes"] == {"task": "mmlu", "formulation": "mc", "shots": 5, "subtask": "astronomy"}
    context = astro.questions[0].choices[0][0]
    assert context.startswith("The following are multiple choice questions (with answers) about astronomy.\n\nQuestion: astronomy question 0?\n A. answer 0a\n")
    assert context.count("Question: astronomy question") == 6 and "college_biology" not in context
    assert context.endswith("Question: astronomy question 0?\n A. answer 0a\n B. answer 0b\n C. answer 0c\n D. answer 0d\nAnswer:")


@needs_pyarrow
def test_missing_datasets_are_one_error_with_every_fetch_command(hf_cache):
    fill_olmes_cache(hf_cache, names={"arc_easy", "boolq", "csqa", "hellaswag", "openbookqa", "socialiqa", "winogrande"})
    with pytest.raises(hub.HubError) as e:
        olmes_suite.load_suite()
    text = str(e.value)
    assert text.startswith("olmes-core: 3 of its 10 datasets (arc_challenge, piqa, mmlu) are not in the HF cache")
    assert "HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set. Fetch them once where there is network, into the same cache:\n" in text
    assert text.endswith(
        "  hf download allenai/ai2_arc --repo-type dataset --revision refs/convert/parquet --include 'ARC-Challenge/test/*.parquet'\n"
        "  hf download ybisk/piqa --repo-type dataset --revision refs/convert/parquet --include 'plain_text/validation/*.parquet'\n"
        "  hf download cais/mmlu --repo-type dataset --revision refs/convert/parquet --include 'all/test/*.parquet'\n"
        "  hf download cais/mmlu --repo-type dataset --revision refs/convert/parquet --include 'all/dev/*.parquet'")
    assert len(olmes_suite.fetch_commands()) == 11 and set(e.value.commands) < set(olmes_suite.fetch_commands())


def test_a_large_split_is_olmes_fixed_sample_of_1000():
    spec = olmes.SUITE["piqa"]
    rows = [{**SHOTS["piqa"][0], "goal": f"goal {n}"} for n in range(1500)]
    data = olmes_suite.Dataset(spec, {"validation": rows}, Path("cache/snapshots/" + "c" * 40))
    rc, mc = olmes_suite.build_suite([data])
    picked = random.Random(1234).sample(range(1500), 1000)
    assert [q.choices[0][0].rsplit("Goal: ", 1)[1] for q in rc.questions] == [f"goal {n}\nAnswer:" for n in picked]
    assert (len(mc.questions), rc.config["commit"]) == (1000, "c" * 40)


def test_the_suite_table_averages_mmlu_over_its_subjects():
    def metrics(task, formulation, primary, value, n, subtask=None):
        info = {"task": task, "formulation": formulation, "shots": 5, **({"subtask": subtask} if subtask else {})}
        return {"olmes": info, "primary_metric": primary, "primary": value, "num_questions": n}

    scored = {"mmlu_a_rc": metrics("mmlu", "rc", "acc_per_char", 0.5, 100, "a"), "mmlu_b_rc": metrics("mmlu", "rc", "acc_per_char", 0.25, 10, "b"),
              "piqa_mc": metrics("piqa", "mc", "acc", 0.75, 20), "arc_easy_rc": metrics("arc_easy", "rc", "acc_per_char", 0.5, 30),
              "my_task": {"primary_metric": "acc", "primary": 1.0, "num_questions": 3}}
    rows = olmes_suite.suite_rows(scored)
    assert rows == [
        {"task": "arc_easy", "formulation": "rc", "shots": 5, "metric": "acc_per_char", "value": 0.5, "questions": 30},
        {"task": "piqa", "formulation": "mc", "shots": 5, "metric": "acc", "value": 0.75, "questions": 20},
        {"task": "mmlu", "formulation": "rc", "shots": 5, "metric": "acc_per_char", "value": 0.375, "questions": 110}]
    # in the run comparison the suite's rows stand for its members; other tasks stay
    assert res.headline_metrics({"tasks": scored, "suites": {"olmes-core": {"rows": rows}}}) == {
        "my_task acc": 1.0, "olmes-core arc_easy rc acc_per_char": 0.5, "olmes-core piqa mc acc": 0.75, "olmes-core mmlu rc acc_per_char": 0.375}


def _eval_sh(args, cwd):
    env = {**os.environ, "NPROC": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(REPO / "scripts" / "eval.sh"), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@needs_pyarrow
def test_eval_sh_runs_olmes_core_and_writes_its_table(hf_cache, neox, tmp_path):
    exported = export_hf(tiny_olmo(neox.vocab_size, max_seq_len=2048), NEOX, tmp_path / "hf")
    fill_olmes_cache(hf_cache, names={"arc_easy"})
    proc = _eval_sh([exported, "--tasks", "olmes-core", "--out", tmp_path / "missing"], tmp_path)
    assert proc.returncode == 2 and "eval: error: olmes-core: 9 of its 10 datasets" in proc.stderr
    assert "hf download cais/mmlu --repo-type dataset" in proc.stderr and not (tmp_path / "missing").exists()

    fill_olmes_cache(hf_cache)
    proc = _eval_sh([exported, "--tasks", "olmes-core", "--out", tmp_path / "out", "--batch-tokens", "8192"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "out" / "olmes-core.md").read_text()
    assert table.splitlines()[0] == "| task | formulation | shots | metric | value |"
    assert len(table.splitlines()) == 2 + 20 and "| mmlu | mc | 5 | acc |" in table and "| arc_challenge | rc | 5 | acc_uncond |" in table
    assert f"**olmes-core**\n\n{table.strip()}" in proc.stdout
    assert "mmlu_astronomy" not in proc.stdout  # the subjects are summed up by the suite's rows
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    suite = results["suites"]["olmes-core"]
    assert [(r["task"], r["formulation"]) for r in suite["rows"]] == [(t, f) for t in olmes.SUITE for f in olmes.FORMULATIONS]
    assert suite["datasets"]["cais/mmlu/all"]["revision"] == "refs/convert/parquet" and results["config"]["eval"]["tasks"] == ["olmes-core"]
    mmlu_rc = [r for r in suite["rows"] if (r["task"], r["formulation"]) == ("mmlu", "rc")][0]
    subjects = [results["tasks"][f"mmlu_{s}_rc_5shot"]["primary"] for s in SUBJECTS]
    assert mmlu_rc["value"] == pytest.approx(sum(subjects) / 2) and mmlu_rc["questions"] == 4
    assert results["tasks"]["csqa_rc_5shot"]["acc_uncond"] is not None and results["stats"]["tasks"]["truncated_contexts"] == 0


def test_the_docs_state_the_suite_as_the_code_runs_it():
    text = (REPO / "docs" / "evaluation.md").read_text()
    assert [line for line in text.splitlines() if line.startswith("hf download ")] == olmes_suite.fetch_commands()
    for spec in olmes.SUITE.values():
        row = next(line for line in text.splitlines() if line.startswith(f"| {spec.name} |"))
        cells = [c.strip() for c in row.split(" | ")]
        assert cells[1] == f"{spec.repo}@{olmes_suite.REVISION} ({spec.config})", row
        assert cells[2].startswith(f"{spec.split}: {f'{spec.limit:,} of' if spec.limit else 'all'} "), row
        assert cells[4].startswith(spec.primary_rc + " "), row
