"""log p(continuation | context) for many requests, each distinct context run through the model once.

A request is (context ids, continuation ids); its score is the sum of log-probs of the continuation
tokens given everything before them, exactly what lm-evaluation-harness computes request by request.
The choices of a question share its context, so most of that work is repeated. How it is shared
(`batching`):

- `packed` (the default), our OLMo (also inside a DeepSpeed engine): each question's context and its
  distinct continuations go into one row, the continuations as branches that see the context and
  not each other (`olmo_ds.eval.packing`); rows of one width, batches of one shape, one forward each,
  the head run only where a token is scored. Compiled blocks serve these forwards (one graph).
- `exact`, our OLMo: each distinct context is run once into a KV cache; the first continuation token
  is read at its last position, and every distinct continuation runs only its own tokens against a
  copy of that cache. Batches hold contexts of one exact length (many small batches and shapes, run
  eagerly). The packed path's reference: both give the same scores up to float rounding.
- Any other model (e.g. transformers', for agreement checks), either setting: one row per distinct
  model input (context + continuation)[:-1]. Inputs that are a prefix of another are read from the
  longer row's logits (the model is causal), so one-token answers to one question cost a single row.

A context longer than the window is truncated from the left (the continuation always kept whole),
counted, and scored on the row path (`exact`) or packed as the shortened context (`packed`); a
continuation that does not fit the window is an error, since its score would be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from olmo_ds.eval.packing import plan_packed
from olmo_ds.eval.scoring import (DistContext, check_batching, length_batches, logits_of, model_device, olmo_of, pad_rows,
                                  run_split, target_logprobs)
from olmo_ds.model import KVCache


@dataclass
class ScoredRequests:
    logprob: np.ndarray  # float64 [N]: sum of log-probs of the continuation tokens (nats)
    greedy: np.ndarray  # bool [N]: every continuation token is the model's arg-max (lm-eval's is_greedy)
    num_tokens: np.ndarray  # int64 [N]: continuation tokens scored
    truncated: np.ndarray  # bool [N]: the context was cut from the left to fit the window
    forward_rows: int  # rows of the forwards the batches need, over all ranks, padding rows included
    forward_tokens: int  # positions those rows hold: what the model ran, padding included
    padding_tokens: int  # of forward_tokens, padding


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
    share_contexts: bool = True,
    batching: str = "packed",
) -> ScoredRequests:
    """Sum of continuation log-probs for each (context ids, continuation ids) request.

    `max_len` is the model's window; `where[i]` names request i in errors (e.g. "file:12").
    With `dist_ctx` the rows are split across ranks and every rank returns all scores.
    `share_contexts`: with our OLMo (or a DeepSpeed engine around it), run each distinct context
    once, as `batching` says (`packed` or `exact`, see the module docstring); without it, and for
    other models, one row per distinct input. Requests with an empty context take that row path too.
    """
    check_batching(batching)
    dist_ctx = dist_ctx or DistContext.current()
    truncated = np.zeros(len(requests), dtype=bool)
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise ValueError(f"{where[i] if where else f'request {i}'}: empty continuation (nothing to score)")
        if len(cont) > max_len:
            raise ValueError(f"{where[i] if where else f'request {i}'}: continuation of {len(cont)} tokens does not fit the model's window of {max_len}")
        truncated[i] = len(ctx) + len(cont) - 1 > max_len

    olmo = olmo_of(model) if share_contexts else None
    packed = olmo is not None and batching == "packed"
    shared = [i for i in range(len(requests)) if olmo is not None and (packed or not truncated[i]) and requests[i][0]]
    taken = set(shared)
    plain = [i for i in range(len(requests)) if i not in taken]

    was_training = getattr(model, "training", False)
    model.eval()
    try:
        scores, greedy, counts = {}, {}, np.zeros(3, dtype=np.int64)  # rows, positions, padding
        # Both parts are decided from the requests alone, so every rank runs them in the same order.
        if plain:
            part, top, c = _score_rows(model, requests, plain, max_len, batch_tokens, pad_id, dist_ctx)
            scores.update(part)
            greedy.update(top)
            counts += c
        if shared:
            if packed:
                part, top, c = _score_packed(model, requests, shared, max_len, batch_tokens, pad_id, dist_ctx)
            else:
                part, top, c = _score_shared_contexts(model, olmo, requests, shared, batch_tokens, pad_id, dist_ctx)
            scores.update(part)
            greedy.update(top)
            counts += c
    finally:
        if was_training:
            model.train()
    return ScoredRequests(
        logprob=np.array([scores[i] for i in range(len(requests))], dtype=np.float64),
        greedy=np.array([greedy[i] for i in range(len(requests))], dtype=bool),
        num_tokens=np.array([len(c) for _, c in requests], dtype=np.int64),
        truncated=truncated,
        forward_rows=int(counts[0]),
        forward_tokens=int(counts[1]),
        padding_tokens=int(counts[2]),
    )


def _score_packed(model, requests, idx: list[int], max_len: int, batch_tokens: int, pad_id: int, dist_ctx: DistContext):
    """Contexts and their continuations packed into fixed-shape rows (`olmo_ds.eval.packing`); a
    context too long for the window is cut from the left first, as the row path would."""
    items: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    item_of: dict[int, int] = {}
    for i in idx:
        ctx, cont = tuple(requests[i][0]), tuple(requests[i][1])
        if len(ctx) + len(cont) - 1 > max_len:
            ctx = ctx[len(ctx) + len(cont) - 1 - max_len:]
        item_of[i] = items.setdefault((ctx, cont), len(items))
    plan = plan_packed(list(items), batch_tokens, pad_id)
    device = model_device(model)

    def step(b: int):
        pb = plan.batches[b]
        out = model(pb.input_ids.to(device), doc_lens=pb.doc_lens.to(device), positions=pb.positions.to(device),
                    branches=pb.branches.to(device), score=(pb.index.to(device), pb.targets.to(device)))
        lp, top = out.logprob.double().cpu().numpy(), out.greedy.cpu().numpy()
        return (dict(zip(pb.items.tolist(), np.add.reduceat(lp, pb.starts).tolist())),
                dict(zip(pb.items.tolist(), np.logical_and.reduceat(top, pb.starts).tolist())))

    scores: dict[int, float] = {}
    greedy: dict[int, bool] = {}
    for part, top in run_split(len(plan.batches), step, dist_ctx):
        scores.update(part)
        greedy.update(top)
    counts = (len(plan.batches) * plan.rows_per_batch, plan.padded_tokens, plan.padded_tokens - plan.tokens)
    return {i: scores[item_of[i]] for i in idx}, {i: greedy[item_of[i]] for i in idx}, counts


def _score_rows(model, requests, idx: list[int], max_len: int, batch_tokens: int, pad_id: int, dist_ctx: DistContext):
    """One model row per distinct input (context + continuation minus its last token), prefix-shared."""
    inputs: list[tuple[int, ...]] = []
    spans: dict[int, tuple[int, tuple[int, ...]]] = {}  # request -> (first scored position, continuation ids)
    for i in idx:
        ctx, cont = requests[i]
        full = (list(ctx) + list(cont))[-(max_len + 1) :]  # truncated from the left when too long
        row = tuple(full[:-1])
        inputs.append(row)
        spans[i] = (len(row) - len(cont), tuple(cont))

    rows, host = _host_rows(inputs)
    by_row: list[list[int]] = [[] for _ in rows]
    for i, r in zip(idx, host):
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
        targets = torch.as_tensor(targets, device=device)
        lp = target_logprobs(picked, targets).double().cpu().numpy()
        top = (picked.argmax(-1) == targets).cpu().numpy()
        lengths = [len(spans[i][1]) for i in members]
        return _sums(members, lengths, lp), _all(members, lengths, top)

    scores, greedy = {}, {}
    for part, top in run_split(len(batches), step, dist_ctx):
        scores.update(part)
        greedy.update(top)
    positions = sum(len(batch) * max(len(rows[r]) for r in batch) for batch in batches)
    return scores, greedy, (len(rows), positions, positions - sum(len(r) for r in rows))


def _sums(keys: list, lengths: list[int], values: np.ndarray) -> dict:
    return _reduce(keys, lengths, values, lambda part: float(part.sum()))


def _all(keys: list, lengths: list[int], values: np.ndarray) -> dict:
    return _reduce(keys, lengths, values, lambda part: bool(part.all()))


def _reduce(keys: list, lengths: list[int], values: np.ndarray, fn) -> dict:
    """fn over consecutive runs of `values`, `lengths[k]` long, keyed by `keys[k]`."""
    out, offset = {}, 0
    for key, n in zip(keys, lengths):
        out[key] = fn(values[offset : offset + n])
        offset += n
    return out


def _score_shared_contexts(model, olmo, requests, idx: list[int], batch_tokens: int, pad_id: int, dist_ctx: DistContext):
    """Each distinct context run once (once per batch, for a context whose continuations need several);
    its continuations run on a copy of its keys and values.

    The first continuation token is scored from the context's last position; the rest from one row
    per distinct continuation (its tokens but the last) attending to the copied cache. Contexts of
    one batch have one length (the cache has one position counter), so batches are formed by
    length, longest first. Every batch is two forward passes, also when no continuation has a
    second token, to keep ZeRO-3 ranks in step.
    """

    contexts: dict[tuple[int, ...], int] = {}
    continuations: list[dict[tuple[int, ...], int]] = []
    key_of: dict[int, tuple[int, int]] = {}
    for i in idx:
        ctx, cont = tuple(requests[i][0]), tuple(requests[i][1])
        c = contexts.setdefault(ctx, len(contexts))
        if c == len(continuations):
            continuations.append({})
        key_of[i] = (c, continuations[c].setdefault(cont, len(continuations[c])))
    ctx_list = list(contexts)
    conts = [list(d) for d in continuations]

    # A unit is a context with some of its continuations: one context row, its tails as rows of their own.
    # A context with more continuations than fit one batch (the unconditional "Answer:", shared by every
    # question of a task) is split into several units, each running the context again.
    units: list[tuple[int, list[int]]] = []
    for c, ctx in enumerate(ctx_list):
        chunk, width, n_tails = [], 0, 0
        for k, cont in enumerate(conts[c]):
            new_width, new_tails = max(width, len(cont) - 1), n_tails + (len(cont) > 1)
            if chunk and (len(ctx) + new_tails * new_width > batch_tokens or len(chunk) + 1 > batch_tokens):
                units.append((c, chunk))
                chunk, new_width, new_tails = [], len(cont) - 1, int(len(cont) > 1)
            chunk.append(k)
            width, n_tails = new_width, new_tails
        units.append((c, chunk))

    batches: list[list[tuple[int, list[int]]]] = []
    current, width, n_rows = [], 0, 0
    for c, ks in sorted(units, key=lambda u: (-len(ctx_list[u[0]]), u[0], u[1][0])):
        tails = [len(conts[c][k]) - 1 for k in ks if len(conts[c][k]) > 1]
        new_width, new_rows = max([width, *tails]), n_rows + len(tails)
        fits = (len(current) + 1) * len(ctx_list[c]) + new_rows * new_width <= batch_tokens
        if current and (len(ctx_list[current[0][0]]) != len(ctx_list[c]) or not fits):
            batches.append(current)
            current, new_width, new_rows = [], max([0, *tails]), len(tails)
        current.append((c, ks))
        width, n_rows = new_width, new_rows
    if current:
        batches.append(current)

    device = model_device(model)
    dtype = next(olmo.parameters()).dtype
    n_layers = olmo.cfg.n_layers

    def step(b: int) -> dict[tuple[int, int], float]:
        batch = batches[b]
        length = len(ctx_list[batch[0][0]])
        cache = KVCache(olmo.cfg, len(batch), length, device, dtype)
        ctx_logits = logits_of(model, torch.as_tensor([ctx_list[c] for c, _ in batch], device=device), cache=cache)
        tails = [(pos, c, k) for pos, (c, ks) in enumerate(batch) for k in ks if len(conts[c][k]) > 1]
        tail_inputs = [list(conts[c][k][:-1]) for _, c, k in tails] or [[pad_id]]
        owner = torch.as_tensor([pos for pos, _, _ in tails] or [0], device=device)
        tail_cache = KVCache(olmo.cfg, len(tail_inputs), length + max(len(t) for t in tail_inputs), device, dtype)
        for layer in range(n_layers):
            tail_cache.keys[layer][:, :length] = cache.keys[layer][owner]
            tail_cache.values[layer][:, :length] = cache.values[layer][owner]
        tail_cache.pos = length
        tail_logits = logits_of(model, pad_rows(tail_inputs, pad_id, device), cache=tail_cache)

        keys = [(c, k) for c, ks in batch for k in ks]
        first = [pos for pos, (_, ks) in enumerate(batch) for _ in ks]
        row_of = {(c, k): r for r, (_, c, k) in enumerate(tails)}
        picked = [ctx_logits[torch.as_tensor(first, device=device), length - 1]]
        targets = [conts[c][k][0] for c, k in keys]
        rest_rows = [row_of[key] for key in keys for _ in conts[key[0]][key[1]][1:]]
        rest_pos = [j for key in keys for j in range(len(conts[key[0]][key[1]]) - 1)]
        if rest_rows:
            picked.append(tail_logits[torch.as_tensor(rest_rows, device=device), torch.as_tensor(rest_pos, device=device)])
            targets += [t for c, k in keys for t in conts[c][k][1:]]
        # Order the scored tokens by key: the first token of every key, then the rest key by key.
        picked, targets = torch.cat(picked), torch.as_tensor(targets, device=device)
        lp = target_logprobs(picked, targets).double().cpu().numpy()
        top = (picked.argmax(-1) == targets).cpu().numpy()
        n = len(keys)
        rest_lengths = [len(conts[c][k]) - 1 for c, k in keys]
        rest, rest_top = _sums(keys, rest_lengths, lp[n:]), _all(keys, rest_lengths, top[n:])
        return ({key: float(lp[j]) + rest[key] for j, key in enumerate(keys)},
                {key: bool(top[j]) and rest_top[key] for j, key in enumerate(keys)})

    scores: dict[tuple[int, int], float] = {}
    greedy: dict[tuple[int, int], bool] = {}
    for part, top in run_split(len(batches), step, dist_ctx):
        scores.update(part)
        greedy.update(top)
    rows, positions, tokens = 0, 0, 0  # tokens: what the positions hold but padding (a repeated context counts again)
    for batch in batches:  # contexts of one length, then the tails padded to the longest (one pad token if none)
        tails = [len(conts[c][k]) - 1 for c, ks in batch for k in ks if len(conts[c][k]) > 1]
        rows += len(batch) + max(len(tails), 1)
        positions += len(batch) * len(ctx_list[batch[0][0]]) + (len(tails) * max(tails) if tails else 1)
        tokens += len(batch) * len(ctx_list[batch[0][0]]) + sum(tails)
    return {i: scores[key_of[i]] for i in idx}, {i: greedy[key_of[i]] for i in idx}, (rows, positions, positions - tokens)
