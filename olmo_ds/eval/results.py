"""Where evaluation results go: results.json, a markdown table, TensorBoard, and run-wide comparisons.

One evaluation of one checkpoint writes `results.json` (by default in `RUN/eval/step-NNNNNNN/`,
beside, not inside, the checkpoint, so pruning checkpoints never loses their scores) and adds its
scalars to the run's TensorBoard directory `RUN/tb` at the checkpoint's step, under the same tags
the training loop's evaluator uses (`scalars`). `compare_run` then reads every `results.json` of
the run into one metric-vs-step table and plot.

A suite (`--tasks olmes-core`) adds its table under `suites` in results.json and as `<suite>.md` beside
it: one row per task and formulation (task, formulation, shots, metric, value); its member tasks stay in
`tasks`, each with its place in the suite under "olmes", and are summed up by the suite's rows in the
printed table, the TensorBoard tags `eval/<suite>/<task>_<formulation>` and the run comparison.

A generative task (`olmo_ds.eval.generative`) has its metrics in `tasks` like any other (marked
"kind": "generative", its primary metric first in the comparison) and its per-example prompts, completions
and scores in `<task>.outputs.jsonl` beside results.json, for inspection.

An RL prompt source (`olmo_ds.eval.rl`) has its metrics under `rl` (per source: `solve_rate` and `reward_mean`, or
`pass_at_k` and `reward_mean` when sampled, each also per verifier as `<metric>/<verifier>`; the prompts, the
verifiers' prompt counts, how it was decoded), TensorBoard tags `eval/<source>/<metric>` (the in-loop evaluation's),
and every prompt's answers, rewards and the verifier's reasons in `<source>.outputs.jsonl`.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path

import olmo_ds
from olmo_ds.atomic import atomic_write_bytes, atomic_write_json

RESULTS = "results.json"
EVAL_DIR = "eval"
TB_DIR = "tb"
COMPARISON_MD = "comparison.md"
COMPARISON_PNG = "comparison.png"
PPL_TAGS = {"ce_loss": "loss", "perplexity": "ppl", "bits_per_byte": "bpb"}


def versions() -> dict[str, str]:
    import numpy
    import tokenizers
    import torch

    found = {"olmo_ds": olmo_ds.__version__, "torch": torch.__version__, "numpy": numpy.__version__,
             "tokenizers": tokenizers.__version__, "python": platform.python_version(), "cuda": torch.version.cuda or "none"}
    try:
        import deepspeed

        found["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    return found


def build_results(*, target: dict, perplexity: dict[str, dict], tasks: dict[str, dict], stats: dict, config: dict,
                  suites: dict[str, dict] | None = None, preference: dict[str, dict] | None = None,
                  rl: dict[str, dict] | None = None) -> dict:
    """The results.json document (see the module docstring); `preference`: per preference source, the metrics of
    `olmo_ds.eval.preference` (loss, rewards/*, logps/*, pairs) and where its reference came from; `rl`: per RL
    prompt source, the metrics of `olmo_ds.eval.rl` and how its prompts were answered."""
    return {
        **target,
        "perplexity": perplexity,
        "preference": preference or {},
        "rl": rl or {},
        "tasks": tasks,
        "suites": suites or {},
        "stats": stats,
        "config": config,
        "versions": versions(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(out_dir: Path, results: dict, outputs: dict[str, list[dict]] | None = None) -> Path:
    """results.json (last, so that it stands for a complete evaluation), the suites' tables and the
    generative tasks' `<task>.outputs.jsonl` (one JSON object per example)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in (outputs or {}).items():
        atomic_write_bytes(out_dir / f"{name}.outputs.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    path = out_dir / RESULTS
    atomic_write_json(path, _finite(results))
    for name, suite in results.get("suites", {}).items():
        atomic_write_bytes(out_dir / f"{name}.md", (suite_table(suite["rows"]) + "\n").encode())
    return path


def _finite(obj):
    """NaN/inf become null: results.json must be strict JSON that any tool reads."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def preference_scalars(preference: dict[str, dict]) -> dict[str, float]:
    """`eval/<source>/<metric>` of each preference source, the tags in-loop evaluation writes for its pairs."""
    return {f"eval/{source}/{metric}": float(v) for source, r in preference.items() for metric, v in r.items()
            if metric == "loss" or metric == "pairs" or metric.startswith(("rewards/", "logps/"))}


def _rl_metric(name: str) -> bool:
    return name.startswith(("solve_rate", "reward_mean", "pass_at_"))


def rl_scalars(rl: dict[str, dict]) -> dict[str, float]:
    """`eval/<source>/<metric>[/<verifier>]` of each RL prompt source: greedily, the tags the in-loop evaluation writes."""
    return {f"eval/{source}/{metric}": float(v) for source, r in rl.items() for metric, v in r.items() if _rl_metric(metric)}


def _rl_primary(r: dict) -> str:
    return "solve_rate" if "solve_rate" in r else "pass_at_1"


def scalars(perplexity: dict[str, dict], tasks: dict[str, dict]) -> dict[str, float]:
    """TensorBoard tags -> values, the tags the training loop's evaluator writes
    (olmo_ds/train/evaluation.py), so offline and in-loop points share one chart:
    `eval/<source>/{loss,ppl,bpb}` and `eval/<task>/<metric>` for every numeric task metric."""
    out = {}
    for source, r in perplexity.items():
        for metric, tag in PPL_TAGS.items():
            out[f"eval/{source}/{tag}"] = r[metric]
    for task, r in tasks.items():
        for metric, value in r.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"eval/{task}/{metric}"] = float(value)
    return out


def suite_scalars(suites: dict[str, dict]) -> dict[str, float]:
    """`eval/<suite>/<task>_<formulation>`: each suite row's value (its primary metric)."""
    return {f"eval/{name}/{row['task']}_{row['formulation']}": row["value"] for name, suite in suites.items() for row in suite["rows"]}


def write_tensorboard(log_dir: Path, step: int, values: dict[str, float]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    try:
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                writer.add_scalar(tag, value, step)
    finally:
        writer.close()


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


SUITE_COLUMNS = ["task", "formulation", "shots", "metric", "value"]


def suite_table(rows: list[dict]) -> str:
    return _table(SUITE_COLUMNS, [[row[c] for c in SUITE_COLUMNS] for row in rows])


def _in_suite(metrics: dict) -> bool:
    return "olmes" in metrics


def _generative(metrics: dict) -> bool:
    return metrics.get("kind") == "generative"


def markdown(results: dict) -> str:
    """The human summary printed on stdout."""
    parts = []
    head = f"**{results.get('path')}**"
    if results.get("step") is not None:
        head += f" — step {results['step']:,}"
    if results.get("tokens_seen") is not None:
        head += f", {results['tokens_seen']:,} tokens seen"
    parts.append(head)
    if results["perplexity"]:
        rows = [[name, r["tokens"], r["ce_loss"], r["perplexity"], r["bits_per_byte"], round(r["tokens_per_second"]),
                 round(r["rows_per_second"]), round(r["forward_tokens_per_second"])] for name, r in results["perplexity"].items()]
        parts.append(_table(["source", "tokens", "ce_loss", "perplexity", "bits/byte", "tokens/s", "rows/s", "forward tokens/s"], rows))
    if results.get("preference"):
        rows = [[name, r["pairs"], r["loss"], r["rewards/accuracy"], r["rewards/margin"], r["rewards/chosen"], r["rewards/rejected"],
                 r["reference"]] for name, r in results["preference"].items()]
        parts.append(_table(["pairs source", "pairs", "loss", "accuracy", "margin", "chosen reward", "rejected reward", "reference"], rows))
    if results.get("rl"):
        rows = []
        for name, r in results["rl"].items():
            d = r["decoding"]
            how = "greedy" if d["temperature"] == 0 else f"{d['samples']} samples, T {d['temperature']:g}, seed {d['seed']}"
            for verifier in [None, *r["verifiers"]]:
                at = f"/{verifier}" if verifier else ""
                passes = ", ".join(f"{m.split('/')[0]} {v:.4f}" for m, v in r.items() if m.startswith("pass_at_") and m.endswith(at)
                                   and (verifier or "/" not in m))
                rows.append([name, verifier or "all", r["verifiers"][verifier] if verifier else r["prompts"], r.get(f"solve_rate{at}"),
                             passes or "–", r[f"reward_mean{at}"], how])
        parts.append(_table(["RL prompts", "verifier", "prompts", "solve rate", "pass@k", "reward mean", "answers"], rows))
        gen = results["stats"].get("rl_generation", {})
        if gen:
            parts.append(f"{gen['requests']:,} answers, {gen['new_tokens']:,} new tokens in {gen['seconds']:.2f} s: "
                         f"{gen['new_tokens_per_second']:,.0f} new tokens/s (rank 0)")
    alone = {name: r for name, r in results["tasks"].items() if not _in_suite(r) and not _generative(r)}
    if alone:
        rows = []
        for name, r in alone.items():
            rows.append([name, r["num_questions"], r["acc"], r["acc_per_token"], r["acc_per_char"], r.get("acc_uncond"),
                         f"{r['primary_metric']} {r['primary']:.4f} ± {r['primary_stderr']:.4f}", r["truncated_contexts"]])
        parts.append(_table(["task", "questions", "acc", "acc_per_token", "acc_per_char", "acc_uncond", "primary", "truncated"], rows))
    for name, suite in results.get("suites", {}).items():
        parts.append(f"**{name}**\n\n{suite_table(suite['rows'])}")
    written = {name: r for name, r in results["tasks"].items() if _generative(r)}
    if written:
        rows = [[name, r["num_questions"], f"{r['primary_metric']} {r['primary']:.4f}",
                 ", ".join(f"{k} {v:.4f}" for k, v in r.items() if k.endswith(("_acc", "exact_match")) and k != r["primary_metric"]) or "–",
                 "yes" if r["chat_template"] else "no", r.get("prompts_too_long", 0), r.get("clipped_budgets", 0), r["outputs"]]
                for name, r in written.items()]
        parts.append(_table(["generative task", "questions", "primary", "other metrics", "chat template", "prompts too long (not scored)",
                             "budgets clipped to the window", "outputs"], rows))
        gen = results["stats"].get("generation", {})
        if gen:
            parts.append(f"{gen['requests']:,} generations, {gen['new_tokens']:,} new tokens in {gen['seconds']:.2f} s: "
                         f"{gen['new_tokens_per_second']:,.0f} new tokens/s")
    if any(not _generative(r) for r in results["tasks"].values()):
        st = results["stats"].get("tasks", {})
        if st:
            parts.append(
                f"{st['requests']:,} requests ({st['request_tokens']:,} tokens), {st['distinct_contexts']:,} distinct contexts, "
                f"{st['forward_rows']:,} model rows ({st['batching']} batching), {st['score_seconds']:.2f} s: "
                f"{st['requests_per_second']:,.0f} requests/s, {st['request_tokens_per_second']:,.0f} request tokens/s, "
                f"{st['forward_tokens_per_second']:,.0f} forward tokens/s"
            )
    return "\n\n".join(parts)


def headline_metrics(results: dict) -> dict[str, float]:
    """The numbers worth a line in a cross-checkpoint comparison: bpb per source, primary per task."""
    out = {}
    for source, r in results.get("perplexity", {}).items():
        out[f"{source} bits/byte"] = r["bits_per_byte"]
    for source, r in results.get("rl", {}).items():
        out[f"{source} {_rl_primary(r)}"] = r[_rl_primary(r)]
    for task, r in results.get("tasks", {}).items():
        if not _in_suite(r):
            out[f"{task} {r['primary_metric']}"] = r["primary"]
    for name, suite in results.get("suites", {}).items():
        for row in suite["rows"]:
            out[f"{name} {row['task']} {row['formulation']} {row['metric']}"] = row["value"]
    return out


def compare_run(run_dir: Path) -> tuple[str, Path | None]:
    """Table and PNG plot of every headline metric against step, over the run's evaluated checkpoints.

    Returns (markdown table, path of the plot or None when fewer than one result exists);
    writes both under `RUN/eval/`.
    """
    eval_dir = Path(run_dir) / EVAL_DIR
    rows = []
    for path in sorted(eval_dir.glob(f"step-*/{RESULTS}")):
        results = json.loads(path.read_text())
        if results.get("step") is not None:
            rows.append((results["step"], results.get("tokens_seen"), headline_metrics(results)))
    if not rows:
        return "", None
    rows.sort(key=lambda r: r[0])
    names = sorted({m for _, _, metrics in rows for m in metrics})
    table = _table(["step", "tokens seen"] + names, [[step, tokens] + [metrics.get(n) for n in names] for step, tokens, metrics in rows])
    atomic_write_bytes(eval_dir / COMPARISON_MD, (table + "\n").encode())
    png = eval_dir / COMPARISON_PNG
    _plot(rows, names, png, title=str(Path(run_dir).name))
    return table, png


def _plot(rows, names: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    cols = min(3, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    steps = [r[0] for r in rows]
    for ax, name in zip(axes.flat, names):
        values = [r[2].get(name) for r in rows]
        points = [(s, v) for s, v in zip(steps, values) if v is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
