"""Multiple-choice task files: OLMES/oe-eval request dumps and a plain JSON-lines format.

A task is a list of questions; a question is a list of (context, continuation) choices and the
index of the gold one. Two file formats produce it:

- OLMES / oe-eval (`DIR/requests.jsonl.gz` + `DIR/config.json`): one `loglikelihood` request per
  choice with `request.context`, `request.continuation`, `doc_id`, `idx` (choice index) and
  `label` (gold index); `config.json` names the task and its `primary_metric`. Requests with
  `doc_id >= metric_kwargs.uncond_docid_offset` are the unconditional ones (context "Answer:")
  used by the `acc_uncond` metric; they are kept per question, scored only when asked for.
- plain JSON lines (`*.jsonl`, `*.jsonl.gz`): `{"context": str, "choices": [str, ...], "gold": int}`,
  each choice appended to the context as written. Its primary metric is `acc`.

Every record is checked when read, before any model runs: a malformed line, a missing or
mistyped field, or a gold index outside the choices is an error naming the file and line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from olmo_ds.eval.jsonl import read_records

OLMES_REQUESTS = "requests.jsonl.gz"
OLMES_CONFIG = "config.json"
# OLMES writes the raw-accuracy metric as "acc_raw"; we call it "acc".
METRIC_ALIASES = {"acc_raw": "acc"}
METRICS = ("acc", "acc_per_token", "acc_per_char", "acc_per_byte", "acc_uncond")


@dataclass
class Question:
    choices: list[tuple[str, str]]  # (context, continuation) per choice
    gold: int
    where: str  # "file:line" of its first record, for error messages
    uncond: list[tuple[str, str]] | None = None  # unconditional (context, continuation) per choice


@dataclass
class Task:
    name: str
    primary_metric: str
    questions: list[Question]
    path: Path
    config: dict = field(default_factory=dict)

    @property
    def has_uncond(self) -> bool:
        return bool(self.questions) and all(q.uncond is not None for q in self.questions)


def load_task(path: str | Path) -> Task:
    """A task from an OLMES request directory or a plain JSON-lines file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        if not (path / OLMES_REQUESTS).is_file():
            raise FileNotFoundError(f"{path}: not a task directory (expected {OLMES_REQUESTS} and {OLMES_CONFIG}, as written by oe-eval)")
        return _load_olmes(path)
    if path.is_file():
        return _load_plain(path)
    raise FileNotFoundError(f"{path}: no such task file or directory")


TASK_DIRS_ENV = "OLMO_DS_TASK_DIRS"


def default_task_dirs() -> list[Path]:
    """Where task names are looked up when no task directory is given: $OLMO_DS_TASK_DIRS (separated by
    the OS path separator), else nowhere (a task is then named by its path)."""
    return [Path(d) for d in os.environ.get(TASK_DIRS_ENV, "").split(os.pathsep) if d]


def resolve_task(spec: str, task_dirs: list[Path]) -> Path:
    """A task argument as given, or a task name looked up in `task_dirs` (else `default_task_dirs()`)."""
    path = Path(spec)
    if path.exists():
        return path
    task_dirs = list(task_dirs) or default_task_dirs()
    for d in task_dirs:
        if (d / spec).exists():
            return d / spec
    if not task_dirs:
        raise FileNotFoundError(f"task {spec!r}: no such path, and no task directory to look the name up in "
                                f"(give the task's path, --task-dir / eval.task_dirs, or set {TASK_DIRS_ENV})")
    raise FileNotFoundError(f"task {spec!r}: no such path, and no task of that name in {', '.join(map(str, task_dirs))}")


def _field(record: dict, key: str, kind, where: str):
    if key not in record:
        raise ValueError(f"{where}: missing key {key!r}")
    value = record[key]
    # bool is an int in Python; a gold of `true` is a mistake, not index 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {key!r} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _check_gold(gold: int, n: int, where: str) -> None:
    if not 0 <= gold < n:
        raise ValueError(f"{where}: gold index {gold} is out of range for {n} choices")


def _load_plain(path: Path) -> Task:
    questions = []
    for lineno, record in read_records(path):
        where = f"{path}:{lineno}"
        context = _field(record, "context", str, where)
        choices = _field(record, "choices", list, where)
        if len(choices) < 2:
            raise ValueError(f"{where}: 'choices' needs at least 2 entries, got {len(choices)}")
        for j, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise ValueError(f"{where}: choice {j} must be a non-empty string, got {c!r}")
        gold = _field(record, "gold", int, where)
        _check_gold(gold, len(choices), where)
        questions.append(Question([(context, c) for c in choices], gold, where))
    if not questions:
        raise ValueError(f"{path}: task file holds no questions")
    name = path.name.split(".")[0]
    return Task(name, "acc", questions, path)


def _load_olmes(directory: Path) -> Task:
    config_path = directory / OLMES_CONFIG
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{config_path}: missing (oe-eval writes it beside {OLMES_REQUESTS}; it names the primary metric)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: invalid JSON: {e}") from None
    task_config = config.get("task_config", {})
    primary = METRIC_ALIASES.get(task_config.get("primary_metric", "acc_raw"), task_config.get("primary_metric", "acc_raw"))
    if primary not in METRICS:
        raise ValueError(f"{config_path}: primary_metric {task_config.get('primary_metric')!r} is not a multiple-choice metric we compute ({', '.join(METRICS)})")
    offset = task_config.get("metric_kwargs", {}).get("uncond_docid_offset")

    requests_path = directory / OLMES_REQUESTS
    docs: dict[int, dict[int, tuple[str, str]]] = {}
    uncond: dict[int, dict[int, tuple[str, str]]] = {}
    gold: dict[int, int] = {}
    first_line: dict[int, str] = {}
    for lineno, record in read_records(requests_path):
        where = f"{requests_path}:{lineno}"
        if record.get("request_type") != "loglikelihood":
            raise ValueError(f"{where}: request_type {record.get('request_type')!r} is not 'loglikelihood' (only multiple-choice tasks are supported)")
        request = _field(record, "request", dict, where)
        context = _field(request, "context", str, where)
        continuation = _field(request, "continuation", str, where)
        doc_id = _field(record, "doc_id", int, where)
        idx = _field(record, "idx", int, where)
        label = _field(record, "label", int, where)
        if offset is not None and doc_id >= offset:
            uncond.setdefault(doc_id - offset, {})[idx] = (context, continuation)
            continue
        choices = docs.setdefault(doc_id, {})
        if idx in choices:
            raise ValueError(f"{where}: doc_id {doc_id} has choice idx {idx} twice")
        choices[idx] = (context, continuation)
        if gold.setdefault(doc_id, label) != label:
            raise ValueError(f"{where}: doc_id {doc_id} has label {label} here but {gold[doc_id]} at {first_line[doc_id]}")
        first_line.setdefault(doc_id, where)

    questions = []
    for doc_id in sorted(docs):
        choices = docs[doc_id]
        where = first_line[doc_id]
        if sorted(choices) != list(range(len(choices))):
            raise ValueError(f"{where}: doc_id {doc_id} has choice indices {sorted(choices)}, expected 0..{len(choices) - 1}")
        _check_gold(gold[doc_id], len(choices), where)
        u = uncond.get(doc_id)
        if u is not None and sorted(u) != sorted(choices):
            raise ValueError(f"{requests_path}: doc_id {doc_id}'s unconditional requests cover choices {sorted(u)}, expected {sorted(choices)}")
        questions.append(Question([choices[j] for j in range(len(choices))], gold[doc_id], where, [u[j] for j in range(len(u))] if u else None))
    if not questions:
        raise ValueError(f"{requests_path}: holds no requests")
    name = config.get("task_name") or directory.name
    return Task(name, primary, questions, directory, config)
