"""log p(continuation | context) for many requests, each distinct model input run once.

A request is (context ids, continuation ids). The model input is (context + continuation)[:-1] and
the scored positions are the last len(continuation) ones. Many requests share work:

- choices of one question share the context, and for one-token continuations the model input is
  *identical* across choices (it is just the context);
- more generally, when one request's model input is a prefix of another's, the longer row's logits
  already hold every position the shorter one needs (the model is causal).

So the unique inputs are sorted, each input that is a prefix of another is attached to the longest
row extending it, and only those "host" rows are run: every distinct context is scored once.
This is the same result lm-evaluation-harness computes request by request, at a fraction of the cost.

A context longer than the window is truncated from the left (the continuation always kept whole) and
counted; a continuation that does not fit the window is an error, since its score would be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from olmo_ds.eval.scoring import DistContext, length_batches, logits_of, model_device, pad_rows, run_split, target_logprobs


@dataclass
class ScoredRequests:
    logprob: np.ndarray  # float64 [N]: sum of log-probs of the continuation tokens (nats)
    num_tokens: np.ndarray  # int64 [N]: continuation tokens scored
    truncated: np.ndarray  # bool [N]: the context was cut from the left to fit the window
    forward_rows: int  # model rows actually run (distinct inputs after prefix sharing)
    forward_tokens: int  # tokens in those rows (excluding padding)


def _host_rows(inputs: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Distinct inputs reduced to rows no other input extends; and for each input, its host row.

    In lexicographic order a sequence that is a prefix of any other is a prefix of its successor,
    and the successor's host extends it too, so one backward pass settles every host.
    """
    unique = sorted(set(inputs))
    host_of_unique = list(range(len(unique)))
    for i in range(len(unique) - 2, -1, -1):
        a, b = unique[i], unique[i + 1]
        if len(a) <= len(b) and b[: len(a)] == a:
            host_of_unique[i] = host_of_unique[i + 1]
    hosts = sorted(set(host_of_unique))
    row_index = {u: r for r, u in enumerate(hosts)}
    position = {seq: row_index[host_of_unique[i]] for i, seq in enumerate(unique)}
    return [unique[u] for u in hosts], [position[seq] for seq in inputs]


@torch.no_grad()
def score_requests(
    model,
    requests: list[tuple[list[int], list[int]]],
    *,
    max_len: int,
    batch_tokens: int = 16384,
    pad_id: int = 0,
    dist_ctx: DistContext | None = None,
    where: list[str] | None = None,
) -> ScoredRequests:
    """Sum of continuation log-probs for each (context ids, continuation ids) request.

    `max_len` is the model's window; `where[i]` names request i in errors (e.g. "file: doc 12").
    With `dist_ctx` the rows are split across ranks and every rank returns all scores.
    """
    dist_ctx = dist_ctx or DistContext.current()
    inputs: list[tuple[int, ...]] = []
    spans: list[tuple[int, tuple[int, ...]]] = []  # (first scored position, continuation ids)
    truncated = np.zeros(len(requests), dtype=bool)
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise ValueError(f"{where[i] if where else f'request {i}'}: empty continuation (nothing to score)")
        if len(cont) > max_len:
            raise ValueError(f"{where[i] if where else f'request {i}'}: continuation of {len(cont)} tokens does not fit the model's window of {max_len}")
        full = list(ctx) + list(cont)
        if len(full) - 1 > max_len:
            full = full[-(max_len + 1) :]
            truncated[i] = True
        row = tuple(full[:-1])
        inputs.append(row)
        spans.append((len(row) - len(cont), tuple(cont)))

    rows, host = _host_rows(inputs)
    by_row: list[list[int]] = [[] for _ in rows]
    for i, r in enumerate(host):
        by_row[r].append(i)
    batches = length_batches([len(r) for r in rows], batch_tokens)
    device = model_device(model)

    def step(b: int) -> dict[int, float]:
        batch = batches[b]
        logits = logits_of(model, pad_rows([rows[r] for r in batch], pad_id, device))
        # Every scored (row, position, target) of the batch in one gather and one copy to the host.
        members = [i for r in batch for i in by_row[r]]
        row_idx = [k for k, r in enumerate(batch) for i in by_row[r] for _ in spans[i][1]]
        pos_idx = [spans[i][0] + j for i in members for j in range(len(spans[i][1]))]
        targets = [t for i in members for t in spans[i][1]]
        picked = logits[torch.as_tensor(row_idx, device=device), torch.as_tensor(pos_idx, device=device)]
        lp = target_logprobs(picked, torch.as_tensor(targets, device=device)).double().cpu().numpy()
        scores, offset = {}, 0
        for i in members:
            n = len(spans[i][1])
            scores[i] = float(lp[offset : offset + n].sum())
            offset += n
        return scores

    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        results = run_split(len(batches), step, dist_ctx)
    finally:
        if was_training:
            model.train()
    logprob = np.empty(len(requests), dtype=np.float64)
    for part in results:
        for i, v in part.items():
            logprob[i] = v
    return ScoredRequests(
        logprob=logprob,
        num_tokens=np.array([len(c) for _, c in spans], dtype=np.int64),
        truncated=truncated,
        forward_rows=len(rows),
        forward_tokens=sum(len(r) for r in rows),
    )
