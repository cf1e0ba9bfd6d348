"""Generative tasks: the model writes, and the text is scored (`--tasks gsm8k[=SOURCE]`, `--tasks ifeval[=SOURCE]`).

A task is a kind (`KINDS`: `olmo_ds.eval.gsm8k`, `olmo_ds.eval.ifeval`, each the prompt format, the stop
strings, the new-token limit and the scoring of one benchmark as OLMES runs it) and its rows, read from
- a local JSON-lines file (`gsm8k=tests/eval/fixtures/gsm8k.jsonl`) in the dataset's own layout, every row
  checked when read (an error names the file and line), or
- the Hugging Face hub (`gsm8k`, `gsm8k=openai/gsm8k[@REVISION]`): the dataset's parquet conversion through
  the HF cache (`olmo_ds.hub.resolve_dataset`); offline and not cached, the error names the command that
  fetches it. The commit read goes into the task's config, and so into results.json.

Evaluation (`evaluate_generative`): each prompt is the kind's text, or, when the checkpoint has a chat
template, that text as one user turn rendered with the template's generation prompt (the turn's end then
stops the reply; the kind's stop strings are for continuations of plain text and are not used). Decoding is
greedy and batched (`olmo_ds.model.decode`); a prompt that would not leave room for the new tokens in the
model's window is cut from the left, as lm-eval does, and counted. Several ranks split the questions and
gather the scores. Every example's prompt, completion and score come back for `<task>.outputs.jsonl`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from olmo_ds import hub
from olmo_ds.chat import ChatEncoder
from olmo_ds.eval import gsm8k, ifeval
from olmo_ds.eval.jsonl import read_records
from olmo_ds.eval.olmes_suite import REVISION, read_parquet
from olmo_ds.eval.scoring import DistContext
from olmo_ds.model.decode import Request, generate, sequences_that_fit

KINDS = {gsm8k.NAME: gsm8k, ifeval.NAME: ifeval}


@dataclass
class Example:
    where: str  # "file:line" or "repo@commit/config/split:row"
    text: str  # the prompt as the kind writes it (before any chat template)
    target: object  # gsm8k: the normalised gold; ifeval: its instructions


@dataclass
class GenerativeTask:
    name: str
    kind: str
    examples: list[Example]
    source: str
    config: dict = field(default_factory=dict)

    @property
    def primary_metric(self) -> str:
        return KINDS[self.kind].PRIMARY


def is_generative(spec: str) -> bool:
    """Whether a `--tasks` argument names a generative task: a kind, alone or as KIND=SOURCE."""
    return spec.partition("=")[0] in KINDS and not Path(spec).exists()


def load_generative(spec: str) -> GenerativeTask:
    """The task of `KIND` (the hub's dataset) or `KIND=SOURCE` (a JSON-lines file, or a hub id)."""
    kind, _, source = spec.partition("=")
    module = KINDS[kind]
    repo, config, split = module.HUB
    if source and Path(source).exists():
        rows = [(f"{source}:{lineno}", record) for lineno, record in read_records(Path(source))]
        where, extra = source, {}
    else:
        if source:
            parsed = hub.parse_hub_id(source)
            if parsed is None:
                raise FileNotFoundError(f"--tasks {spec}: {source} is no such file, nor a hub dataset id (org/name[@revision])")
            repo, revision = parsed[0], parsed[1] or REVISION
        else:
            revision = REVISION
        snapshot = hub.resolve_dataset(repo, revision, [f"{config}/{split}/*.parquet"], what=f"--tasks {kind}")
        where = f"{repo}@{snapshot.name}/{config}/{split}"
        rows = [(f"{where}:{n}", row) for n, row in enumerate(read_parquet(snapshot, config, split))]
        extra = {"repo": repo, "revision": revision, "commit": snapshot.name}
    examples, skipped = [], {}
    for at, row in rows:
        if kind == ifeval.NAME and extra and ifeval.unsupported(row):
            for instruction in ifeval.unsupported(row):  # the hub's full set: rows this module cannot verify are counted
                skipped[instruction] = skipped.get(instruction, 0) + 1
            continue
        if kind == gsm8k.NAME:
            question, gold = gsm8k.check_row(row, at)
            examples.append(Example(at, gsm8k.prompt(question), gold))
        else:
            text, instructions = ifeval.check_row(row, at)
            examples.append(Example(at, text, instructions))
    if not examples:
        raise ValueError(f"--tasks {spec}: {where} holds no {kind} rows" + (" that this evaluation can verify" if skipped else ""))
    config = {"kind": kind, "source": where, **extra, "max_new_tokens": module.MAX_NEW_TOKENS, "stop": list(module.STOP)}
    if skipped:
        config["skipped_rows"] = len(rows) - len(examples)
        config["unsupported_instructions"] = dict(sorted(skipped.items()))
    return GenerativeTask(kind, kind, examples, where, config)


@dataclass
class GenerativeResult:
    tasks: dict[str, dict]  # metrics per task, as multiple choice's (primary_metric, primary, num_questions, ...)
    outputs: dict[str, list[dict]]  # per task, one record per example, in the task's order
    stats: dict


def evaluate_generative(model, tokenizer, tasks: list[GenerativeTask], *, chat: ChatEncoder | None, dist_ctx: DistContext,
                        batch_size: int, limit: int | None = None) -> GenerativeResult:
    """Generate and score every task (see the module docstring); every rank returns the same result."""
    cfg = model.cfg
    param = next(model.parameters())
    stop_ids = chat.turn_end_ids() if chat is not None else [tokenizer.eos_id]
    # Speed is this rank's: its new tokens over its generation time.
    metrics, outputs, totals = {}, {}, {"requests": 0, "new_tokens": 0, "seconds": 0.0}
    for task in tasks:
        module = KINDS[task.kind]
        examples = task.examples[:limit] if limit else task.examples
        mine = list(range(dist_ctx.rank, len(examples), dist_ctx.world))
        requests, truncated = [], 0
        max_new = min(module.MAX_NEW_TOKENS, cfg.max_seq_len - 1)
        for n in mine:
            text = examples[n].text
            ids = chat.encode_prompt([{"role": "user", "content": text}]) if chat is not None else tokenizer.encode(text)
            if len(ids) + max_new > cfg.max_seq_len:
                ids, truncated = ids[-(cfg.max_seq_len - max_new):], truncated + 1
            requests.append(Request(ids, max_new, () if chat is not None else module.STOP))
        records = []
        if requests:
            longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
            fit = sequences_that_fit(cfg, longest, param.dtype, param.device)
            start = time.perf_counter()
            done = generate(model, requests, batch_size=max(1, min(batch_size, fit)), stop_ids=stop_ids, tokenizer=tokenizer)
            totals["seconds"] += time.perf_counter() - start
            totals["new_tokens"] += done.stats["new_tokens"]
            for n, c in zip(mine, done.completions):
                scored = module.score(c.text, examples[n].target)
                records.append({"index": n, "where": examples[n].where, "prompt": examples[n].text, "completion": c.text,
                                "finish": c.finish, "new_tokens": len(c.tokens), **scored})
        parts = dist_ctx.all_gather((records, truncated))
        gathered = sorted((r for part, _ in parts for r in part), key=lambda r: r["index"])
        truncated = sum(count for _, count in parts)
        values = module.metrics(gathered)
        metrics[task.name] = {**values, "primary_metric": task.primary_metric, "primary": values[task.primary_metric],
                              "num_questions": len(gathered), "truncated_prompts": truncated, "kind": "generative",
                              "chat_template": chat is not None, "source": task.source, "config": task.config,
                              "outputs": f"{task.name}.outputs.jsonl"}
        outputs[task.name] = gathered
        totals["requests"] += len(gathered)
    totals["new_tokens_per_second"] = totals["new_tokens"] / max(totals["seconds"], 1e-9)
    return GenerativeResult(metrics, outputs, totals)
