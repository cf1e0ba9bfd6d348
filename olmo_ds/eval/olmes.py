"""The OLMES suite (Gu et al. 2024, the standard OLMo reports): ten multiple-choice tasks built from
their Hugging Face `datasets` rows in the OLMES formulations.

Each task has two formulations:
- RC (ranked classification, "cloze"): the context ends in "Answer:", each choice's text is a
  continuation (" Paris"); scored by log-likelihood, normalised per task (`primary_rc`). The
  unconditional requests ("Answer:" + choice) come with it, for `acc_uncond` (OLMES's "pmi").
- MC (multiple-choice letters): the choices are listed as " A. text" lines in the context, and the
  continuations are the letters " A", " B", ...; scored by raw log-likelihood (`acc`).

Shots: OLMES's standard is 5 curated examples (`olmes_shots.SHOTS`; MMLU: the first 5 of the subject's
dev split), the same for every question, each followed by its gold answer and a blank line. MMLU's
prompts open with the subject line MMLU's authors wrote ("The following are multiple choice questions
(with answers) about astronomy.") and it is scored per subject, 57 tasks whose primary metrics OLMES
averages (macro).

`build_task(spec, rows, formulation, shots)` turns rows (dicts in the HF layout) into a `Task` that
`olmo_ds.eval.multiple_choice` scores like any other. The row readers (`Doc` per task) are checked
against oe-eval's own request dumps in ../shared/eval (tests/eval/test_olmes.py): from HF-layout rows
made of those dumps' `doc` fields, the builder reproduces their requests exactly. Reading the rows from
the Hugging Face cache and running the whole suite: `olmo_ds.eval.olmes_suite`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from olmo_ds.eval.tasks import Question, Task

FORMULATIONS = ("rc", "mc")
LETTERS = "ABCDEFGHIJ"
UNCOND_CONTEXT = "Answer:"


@dataclass(frozen=True)
class Doc:
    """One question as OLMES states it: the query (ending in "Answer:"), the choices' texts, the gold index."""

    query: str
    choices: list[str]
    gold: int
    # The query before its answer prompt, for the MC listing ("Question: ...").
    stem: str = ""


@dataclass(frozen=True)
class OlmesTask:
    name: str
    repo: str  # Hugging Face dataset repo
    config: str  # its configuration (subset), as its parquet conversion names it
    split: str  # evaluated split
    shot_split: str  # where the shots come from: OLMES curated them from "train"; MMLU reads its "dev"
    primary_rc: str  # the RC formulation's primary metric (OLMES normalisation); MC is always "acc"
    doc: Callable[[dict], Doc]
    limit: int | None = None  # OLMES scores a fixed random sample of this many questions of a larger split


def _qa(question: str) -> tuple[str, str]:
    stem = f"Question: {question}"
    return f"{stem}\nAnswer:", stem


def _labelled(row: dict, key: str = "answerKey") -> tuple[list[str], int]:
    """Choices and gold index of rows with `choices: {text, label}` and the gold label under `key`."""
    labels, texts = row["choices"]["label"], row["choices"]["text"]
    if row[key] not in labels:
        raise ValueError(f"gold label {row[key]!r} is not among the choice labels {labels}")
    return list(texts), labels.index(row[key])


def _arc(row: dict) -> Doc:
    choices, gold = _labelled(row)
    query, stem = _qa(row["question"])
    return Doc(query, choices, gold, stem)


def _obqa(row: dict) -> Doc:
    choices, gold = _labelled(row)
    query, stem = _qa(row["question_stem"])
    return Doc(query, choices, gold, stem)


def _csqa(row: dict) -> Doc:
    choices, gold = _labelled(row)
    query, stem = _qa(row["question"])
    return Doc(query, choices, gold, stem)


def _piqa(row: dict) -> Doc:
    stem = f"Goal: {row['goal']}"
    return Doc(f"{stem}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]), stem)


def _siqa(row: dict) -> Doc:
    query, stem = _qa(f"{row['context']} {row['question']}")
    return Doc(query, [row["answerA"], row["answerB"], row["answerC"]], int(row["label"]) - 1, stem)


def _boolq(row: dict) -> Doc:
    stem = f"{row['passage']}\nQuestion: {row['question']}?"
    return Doc(f"{stem}\nAnswer:", ["yes", "no"], 0 if row["answer"] else 1, stem)


def _hellaswag_clean(text: str) -> str:
    # WikiHow markup as lm-eval and OLMES clean it: " [title]" ends a sentence, other [tags] go.
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict) -> Doc:
    query = _hellaswag_clean(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
    return Doc(query, [_hellaswag_clean(e) for e in row["endings"]], int(row["label"]), query)


def _mmlu(row: dict) -> Doc:
    query, stem = _qa(row["question"].strip())
    return Doc(query, list(row["choices"]), int(row["answer"]), stem)


def _winogrande(row: dict) -> Doc:
    """Partial scoring: each option fills the blank in the context; the rest of the sentence is the
    continuation shared by both (`build_task` splits `query` at the blank)."""
    return Doc(row["sentence"], [row["option1"], row["option2"]], int(row["answer"]) - 1, row["sentence"])


# Dataset repos on the Hugging Face hub, read from their parquet conversion (olmes_suite.REVISION): piqa and
# social_i_qa ship loading scripts, which `datasets` no longer runs, so the conversion is all they have, and
# it gives every repo one layout (CONFIG/SPLIT/NNNN.parquet). Limits as oe-eval's `*::olmes` task configs.
SUITE: dict[str, OlmesTask] = {t.name: t for t in [
    OlmesTask("arc_challenge", "allenai/ai2_arc", "ARC-Challenge", "test", "train", "acc_uncond", _arc),
    OlmesTask("arc_easy", "allenai/ai2_arc", "ARC-Easy", "test", "train", "acc_per_char", _arc, limit=1000),
    OlmesTask("boolq", "google/boolq", "default", "validation", "train", "acc", _boolq, limit=1000),
    OlmesTask("csqa", "tau/commonsense_qa", "default", "validation", "train", "acc_uncond", _csqa),
    OlmesTask("hellaswag", "Rowan/hellaswag", "default", "validation", "train", "acc_per_char", _hellaswag, limit=1000),
    OlmesTask("openbookqa", "allenai/openbookqa", "main", "test", "train", "acc_uncond", _obqa),
    OlmesTask("piqa", "ybisk/piqa", "plain_text", "validation", "train", "acc_per_char", _piqa, limit=1000),
    OlmesTask("socialiqa", "allenai/social_i_qa", "default", "validation", "train", "acc_per_char", _siqa, limit=1000),
    OlmesTask("winogrande", "allenai/winogrande", "winogrande_xl", "validation", "train", "acc", _winogrande),
    OlmesTask("mmlu", "cais/mmlu", "all", "test", "dev", "acc_per_char", _mmlu),
]}


def mmlu_description(subject: str) -> str:
    """The line before an MMLU subject's shots: MMLU's own, which OLMES keeps."""
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def _rc_pairs(spec: OlmesTask, doc: Doc) -> list[tuple[str, str]]:
    if spec.doc is _winogrande:
        blank = doc.query.index("_")
        rest = " " + doc.query[blank + 1 :].strip()
        return [(doc.query[:blank] + option, rest) for option in doc.choices]
    return [(doc.query, " " + c) for c in doc.choices]


def _mc_query(doc: Doc) -> str:
    listing = "".join(f"\n {LETTERS[j]}. {c}" for j, c in enumerate(doc.choices))
    return f"{doc.stem}{listing}\nAnswer:"


def _pairs(spec: OlmesTask, doc: Doc, formulation: str) -> list[tuple[str, str]]:
    if formulation == "rc":
        return _rc_pairs(spec, doc)
    return [(_mc_query(doc), f" {LETTERS[j]}") for j in range(len(doc.choices))]


def _shot_text(spec: OlmesTask, doc: Doc, formulation: str) -> str:
    """A solved example: its gold request, context and continuation joined, then a blank line."""
    context, continuation = _pairs(spec, doc, formulation)[doc.gold]
    return f"{context}{continuation}\n\n"


def build_task(spec: OlmesTask, rows: list[dict], formulation: str, shots: list[dict] = (), *, source: str = "",
               subtask: str | None = None, description: str = "", config: dict | None = None) -> Task:
    """The OLMES task of `rows` (HF layout) in `formulation`, each context preceded by `description`
    and the solved `shots`.

    `source` names where the rows came from, for error messages and `Task.path`; `subtask` (an MMLU
    subject) goes into the task's name; `config` is added to the task's config.
    """
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation {formulation!r}: expected one of {', '.join(FORMULATIONS)}")
    prefix = description + "".join(_shot_text(spec, spec.doc(row), formulation) for row in shots)
    questions = []
    for n, row in enumerate(rows):
        where = f"{source or spec.repo}:{spec.split}[{n}]"
        try:
            doc = spec.doc(row)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{where}: not a {spec.name} row in the {spec.repo} layout ({type(e).__name__}: {e})") from None
        pairs = [(prefix + context, continuation) for context, continuation in _pairs(spec, doc, formulation)]
        # Unconditional requests ("Answer:" + choice, for acc_uncond) exist where the choices are the
        # continuations: not for MC letters, not for winogrande, whose choices sit in the context.
        uncond = [(UNCOND_CONTEXT, continuation) for _, continuation in pairs] if formulation == "rc" and spec.doc is not _winogrande else None
        questions.append(Question(pairs, doc.gold, where, uncond))
    primary = spec.primary_rc if formulation == "rc" else "acc"
    name = f"{spec.name}_{subtask + '_' if subtask else ''}{formulation}_{len(shots)}shot"
    return Task(name, primary, questions, Path(source or spec.repo),
                {"repo": spec.repo, "config": spec.config, "split": spec.split, **(config or {})})
