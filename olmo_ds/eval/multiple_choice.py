"""Multiple choice by log-likelihood: the metrics OLMo and OLMES report for ranked-choice tasks.

For each question every choice's continuation is scored as sum log p(continuation | context), and
the prediction is the arg-max of that score under several normalisations:

- `acc`: the raw sum (OLMES `acc_raw`), which favours short answers;
- `acc_per_token`: divided by the continuation's token count;
- `acc_per_char`: divided by its length in characters (OLMo's length normalisation);
- `acc_per_byte`: divided by its UTF-8 bytes;
- `acc_uncond`: minus log p(continuation | "Answer:") (PMI), when the task has unconditional
  requests and they are asked for.

Ties go to the lower index, as in lm-evaluation-harness. `bits_per_byte_corr` is the gold
continuation's bits per byte averaged over questions, a smooth signal that moves long before
accuracy does on a small model.

Contexts and continuations are tokenized separately, each distinct string once, with trailing
whitespace of a context moved to the front of its continuation (lm-evaluation-harness's rule, so
"Answer: " + "Paris" tokenizes like "Answer:" + " Paris", as the model saw it in training).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from olmo_ds.eval.loglikelihood import ScoredRequests, score_requests
from olmo_ds.eval.scoring import DistContext
from olmo_ds.eval.tasks import Question, Task


def _split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


def _encode_unique(tokenizer, texts: set[str]) -> dict[str, list[int]]:
    ordered = sorted(texts)
    return dict(zip(ordered, tokenizer.encode_batch(ordered)))


@dataclass
class MultipleChoiceResult:
    tasks: dict[str, dict]  # task name -> metrics
    stats: dict  # counts and timings of the whole pass (all tasks scored together)
    scored: ScoredRequests | None = None  # per request, in `PreparedTasks.requests` order


@dataclass
class _Entry:
    task: Task
    questions: list[Question]
    with_uncond: bool


@dataclass
class PreparedTasks:
    """Tasks tokenized once, ready to be scored any number of times (e.g. every N training steps)."""

    entries: list[_Entry]
    pairs: list[tuple[str, str]]  # (context, continuation) strings per request, in scoring order
    requests: list[tuple[list[int], list[int]]]  # their token ids
    where: list[str]
    distinct_contexts: int
    tokenize_seconds: float


def prepare_tasks(tokenizer, tasks: list[Task], *, uncond: bool = False, limit: int | None = None) -> PreparedTasks:
    """Tokenize every distinct context and continuation of `tasks` once.

    `uncond` also prepares the unconditional requests (always done for a task whose primary metric
    is `acc_uncond`). `limit` keeps each task's first N questions (a quick look).
    """
    entries = []
    for t in tasks:
        if t.primary_metric == "acc_uncond" and not t.has_uncond:
            raise ValueError(f"{t.path}: primary metric acc_uncond needs unconditional requests, and the task has none")
        entries.append(_Entry(t, t.questions[:limit] if limit else t.questions, (uncond or t.primary_metric == "acc_uncond") and t.has_uncond))
    # Requests in a fixed order: per task, per question, its choices then its unconditional ones.
    pairs: list[tuple[str, str]] = []
    where: list[str] = []
    for e in entries:
        for q in e.questions:
            for context, continuation in q.choices + (q.uncond if e.with_uncond else []):
                pairs.append(_split_whitespace(context, continuation))
                where.append(q.where)
    t0 = time.perf_counter()
    contexts = _encode_unique(tokenizer, {c for c, _ in pairs})
    continuations = _encode_unique(tokenizer, {c for _, c in pairs})
    requests = [(contexts[c], continuations[k]) for c, k in pairs]
    return PreparedTasks(entries, pairs, requests, where, len(contexts), time.perf_counter() - t0)


def evaluate_tasks(
    model,
    tokenizer,
    tasks: list[Task] | PreparedTasks,
    dp_rank: int | None = None,
    dp_world: int | None = None,
    *,
    max_len: int,
    batch_tokens: int = 16384,
    uncond: bool = False,
    limit: int | None = None,
    batching: str = "packed",
) -> MultipleChoiceResult:
    """Score every task; `.tasks` maps each task's name to its metrics. Every rank returns the same numbers.

    `tasks` is a list of `Task` (tokenized here, see `prepare_tasks` for `uncond`/`limit`) or the
    `PreparedTasks` of an earlier `prepare_tasks` call (the in-loop use: tokenize once, score often).
    `dp_rank`/`dp_world` default to torch.distributed's; the rows are split across ranks and the
    per-request scores gathered, so the result does not depend on the world size. All tasks are
    scored in one pass (one set of batches), so short tasks fill the batches of long ones.
    `batching`: `packed` (default) or `exact`, see `olmo_ds.eval.loglikelihood`.
    """
    dist_ctx = DistContext.current() if dp_rank is None else DistContext(dp_rank, dp_world or 1)
    prepared = tasks if isinstance(tasks, PreparedTasks) else prepare_tasks(tokenizer, tasks, uncond=uncond, limit=limit)
    pairs = prepared.pairs
    t0 = time.perf_counter()
    scored = score_requests(model, prepared.requests, max_len=max_len, batch_tokens=batch_tokens, pad_id=tokenizer.pad_id or 0,
                            dist_ctx=dist_ctx, where=prepared.where, batching=batching)
    score_s = time.perf_counter() - t0

    results: dict[str, dict] = {}
    cursor = 0
    for entry in prepared.entries:
        task, questions = entry.task, entry.questions
        hits = {m: 0 for m in ("acc", "acc_per_token", "acc_per_char", "acc_per_byte")}
        if entry.with_uncond:
            hits["acc_uncond"] = 0
        bpb_sum = 0.0
        start = cursor
        for q in questions:
            n = len(q.choices)
            lp = scored.logprob[cursor : cursor + n]
            ntok = scored.num_tokens[cursor : cursor + n]
            conts = [pairs[cursor + j][1] for j in range(n)]
            chars = np.array([len(c) for c in conts], dtype=np.float64)
            nbytes = np.array([len(c.encode("utf-8")) for c in conts], dtype=np.float64)
            cursor += n
            hits["acc"] += int(np.argmax(lp)) == q.gold
            hits["acc_per_token"] += int(np.argmax(lp / ntok)) == q.gold
            hits["acc_per_char"] += int(np.argmax(lp / chars)) == q.gold
            hits["acc_per_byte"] += int(np.argmax(lp / nbytes)) == q.gold
            bpb_sum += -lp[q.gold] / (math.log(2) * nbytes[q.gold])
            if entry.with_uncond:
                hits["acc_uncond"] += int(np.argmax(lp - scored.logprob[cursor : cursor + n])) == q.gold
                cursor += n
        count = len(questions)
        metrics = {m: h / count for m, h in hits.items()}
        primary = metrics[task.primary_metric]
        metrics.update(
            primary_metric=task.primary_metric,
            primary=primary,
            # Sample standard error of the mean (as lm-evaluation-harness reports it): how far apart
            # two checkpoints must be to mean anything.
            primary_stderr=math.sqrt(primary * (1 - primary) / (count - 1)) if count > 1 else float("nan"),
            bits_per_byte_corr=bpb_sum / count,
            num_questions=count,
            num_requests=cursor - start,
            truncated_contexts=int(scored.truncated[start:cursor].sum()),
        )
        results[task.name] = metrics

    scored_tokens = int(scored.num_tokens.sum())
    request_tokens = sum(len(c) + len(k) for c, k in prepared.requests)

    def rate(n: int) -> float:
        return n / score_s if score_s > 0 else float("nan")

    stats = {
        "batching": batching,
        "requests": len(prepared.requests),
        "distinct_contexts": prepared.distinct_contexts,
        "truncated_contexts": int(scored.truncated.sum()),
        "forward_rows": scored.forward_rows,
        "forward_tokens": scored.forward_tokens,
        "padding_tokens": scored.padding_tokens,
        "request_tokens": request_tokens,
        "scored_tokens": scored_tokens,
        "tokenize_seconds": prepared.tokenize_seconds,
        "score_seconds": score_s,
        # Request tokens = context + continuation of every request (what lm-eval users count); forward
        # = every position the model ran, padding included; scored = continuation tokens read.
        "requests_per_second": rate(len(prepared.requests)),
        "request_tokens_per_second": rate(request_tokens),
        "forward_tokens_per_second": rate(scored.forward_tokens),
        "scored_tokens_per_second": rate(scored_tokens),
    }
    return MultipleChoiceResult(results, stats, scored)
