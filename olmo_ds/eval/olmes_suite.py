"""The `olmes-core` suite: OLMES's ten tasks, RC and MC, 5-shot, read from the Hugging Face cache.

Each task's rows come from its dataset repo (`olmes.SUITE`) at `REVISION`, the repo's parquet conversion,
through the standard HF cache (`olmo_ds.hub.resolve_dataset`): a compute node without network reads what
`hf download` put there on a login node, and a task not cached is an error naming the commands that fetch
it, all missing datasets in one message, before any weight is loaded. The commit each dataset was read at
goes into every task's config (and so into results.json).

Questions: the evaluated split in dataset order; a task with an OLMES `limit` (1000) larger than that
keeps the sample `random.Random(1234).sample(rows, limit)`, oe-eval's `random_subsample_seed` 1234.
Shots: `olmes_shots.SHOTS` (MMLU: the subject's first 5 `dev` rows).

`suite_rows` turns the scored tasks into the suite's table: one row per task and formulation, MMLU's
value the mean of its subjects' (OLMES's macro average).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from olmo_ds import hub
from olmo_ds.eval import olmes
from olmo_ds.eval.olmes_shots import SHOTS
from olmo_ds.eval.tasks import Task

SUITE_NAME = "olmes-core"
REVISION = "refs/convert/parquet"
NUM_SHOTS = 5
SUBSAMPLE_SEED = 1234


@dataclass
class Dataset:
    """The rows of one task's splits as read from the cache, and where they were read."""

    spec: olmes.OlmesTask
    splits: dict[str, list[dict]]
    snapshot: Path

    @property
    def commit(self) -> str:
        return self.snapshot.name  # the HF cache names a snapshot by its commit


def splits(spec: olmes.OlmesTask) -> list[str]:
    """The splits the suite reads: the evaluated one, and the shot split unless the shots are curated."""
    return [spec.split] + ([] if spec.name in SHOTS else [spec.shot_split])


def patterns(spec: olmes.OlmesTask) -> list[str]:
    """The files of those splits in the repo's parquet conversion."""
    return [f"{spec.config}/{split}/*.parquet" for split in splits(spec)]


def fetch_commands() -> list[str]:
    """The commands that put the suite's datasets into the HF cache (for a login node)."""
    return [hub.fetch_command(spec.repo, revision=REVISION, repo_type="dataset", include=p)
            for spec in olmes.SUITE.values() for p in patterns(spec)]


def read_datasets() -> list[Dataset]:
    """The ten tasks' rows from the HF cache; one HubError naming the fetch command of every dataset
    that is not there."""
    specs = list(olmes.SUITE.values())
    snapshots, missing = {}, {}
    for spec in specs:
        try:
            snapshots[spec.name] = hub.resolve_dataset(spec.repo, REVISION, patterns(spec))
        except hub.HubError as e:
            missing[spec.name] = e
    if missing:
        from huggingface_hub.constants import HF_HUB_CACHE

        commands = [c for e in missing.values() for c in e.commands]
        why = "; ".join(dict.fromkeys(e.why for e in missing.values()))
        raise hub.HubError(
            f"{SUITE_NAME}: {len(missing)} of its {len(specs)} datasets ({', '.join(missing)}) are not in the HF cache "
            f"({HF_HUB_CACHE}) and {why}. Fetch them once where there is network, into the same cache:\n"
            + "\n".join(f"  {c}" for c in commands), commands, why)
    return [Dataset(spec, {split: read_parquet(snapshots[spec.name], spec.config, split) for split in splits(spec)}, snapshots[spec.name])
            for spec in specs]


def build_suite(datasets: list[Dataset]) -> list[Task]:
    """The suite's tasks: per dataset and formulation one task (MMLU: one per subject)."""
    tasks = []
    for data in datasets:
        spec = data.spec
        rows = data.splits[spec.split]
        if spec.limit is not None and len(rows) > spec.limit:
            rows = random.Random(SUBSAMPLE_SEED).sample(rows, spec.limit)
        source = f"{spec.repo}@{data.commit}/{spec.config}/{spec.split}"
        config = {"revision": REVISION, "commit": data.commit, "suite": SUITE_NAME}
        for formulation in olmes.FORMULATIONS:
            if spec.name == "mmlu":
                tasks += _mmlu_tasks(spec, rows, data.splits[spec.shot_split], formulation, source, config)
                continue
            shots = SHOTS[spec.name][:NUM_SHOTS]
            olmes_info = {"task": spec.name, "formulation": formulation, "shots": len(shots)}
            tasks.append(olmes.build_task(spec, rows, formulation, shots, source=source, config={**config, "olmes": olmes_info}))
    return tasks


def load_suite() -> list[Task]:
    """`build_suite(read_datasets())`: what `--tasks olmes-core` runs."""
    return build_suite(read_datasets())


def suite_rows(task_metrics: dict[str, dict]) -> list[dict]:
    """The suite's table from scored tasks (`MultipleChoiceResult.tasks`, each carrying its task's
    `olmes` config under "olmes"): task, formulation, shots, metric, value, questions; in SUITE order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for metrics in task_metrics.values():
        info = metrics.get("olmes")
        if info:
            groups.setdefault((info["task"], info["formulation"]), []).append(metrics)
    rows = []
    for name in olmes.SUITE:
        for formulation in olmes.FORMULATIONS:
            members = groups.get((name, formulation))
            if not members:
                continue
            rows.append({"task": name, "formulation": formulation, "shots": members[0]["olmes"]["shots"],
                         "metric": members[0]["primary_metric"],
                         "value": sum(m["primary"] for m in members) / len(members),
                         "questions": sum(m["num_questions"] for m in members)})
    return rows


def read_parquet(snapshot: Path, config: str, split: str) -> list[dict]:
    """The rows of `config`/`split` in a dataset's parquet conversion (also the generative tasks' hub rows)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("the hub's datasets are read from their parquet files with pyarrow, which is not installed: "
                         f"pip install pyarrow (or pip install -e '.[parquet]')") from None
    files = sorted(snapshot.glob(f"{config}/{split}/*.parquet"))
    rows = [row for f in files for row in pq.read_table(f).to_pylist()]
    if not rows:
        raise ValueError(f"{snapshot}/{config}/{split}: no rows in {', '.join(f.name for f in files)}")
    return rows


def _mmlu_tasks(spec, rows, dev_rows, formulation, source, config) -> list[Task]:
    """One task per subject, in the order the subjects come in the data, each with the subject's line
    and its first dev rows as shots."""
    by_subject: dict[str, list[dict]] = {}
    for row in rows:
        by_subject.setdefault(row["subject"], []).append(row)
    shots: dict[str, list[dict]] = {}
    for row in dev_rows:
        shots.setdefault(row["subject"], []).append(row)
    tasks = []
    for subject, subject_rows in by_subject.items():
        subject_shots = shots.get(subject, [])[:NUM_SHOTS]
        info = {"task": spec.name, "formulation": formulation, "shots": len(subject_shots), "subtask": subject}
        tasks.append(olmes.build_task(spec, subject_rows, formulation, subject_shots, source=source, subtask=subject,
                                      description=olmes.mmlu_description(subject), config={**config, "olmes": info}))
    return tasks
