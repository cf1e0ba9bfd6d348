"""Multiple-choice scoring on the real OLMES tasks with a tiny random OLMo, against brute force.

The model is random, so accuracies mean nothing; what is checked is the mechanics: every request's
log-prob equals a direct one-request-at-a-time computation, each distinct model input is run once,
the metrics follow from the scores, left truncation is counted, and bad input is refused.
"""

import json
import math

import numpy as np
import pytest
import torch

from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.tasks import load_task

from eval_testlib import ARC_EASY, PIQA

torch.set_num_threads(1)


class RowCounter(torch.nn.Module):
    """The model, counting the rows it is run on (an opaque model: scored one row per input)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.rows, self.context_rows = model, 0, 0

    def forward(self, input_ids, cache=None, **kwargs):
        self.rows += input_ids.shape[0]
        if cache is not None and cache.pos == 0:
            self.context_rows += input_ids.shape[0]
        return self.inner(input_ids, cache=cache, **kwargs)


class EngineLike(RowCounter):
    """Our OLMo behind `.module`, as a DeepSpeed engine holds it: contexts share their KV cache."""

    @property
    def module(self):
        return self.inner


@torch.no_grad()
def brute_force(model, ctx, cont, max_len, greedy=False):
    """log p(cont | ctx) one request at a time; with `greedy`, also whether every token is the arg-max."""
    full = (list(ctx) + list(cont))[-(max_len + 1) :]
    logp = torch.log_softmax(model(torch.tensor([full[:-1]])).float()[0], dim=-1)
    positions = range(len(full) - 1 - len(cont), len(full) - 1)
    total = sum(float(logp[p, t]) for p, t in zip(positions, cont))
    return (total, all(int(logp[p].argmax()) == t for p, t in zip(positions, cont))) if greedy else total


@torch.no_grad()
def greedy_tokens(model, ctx, n):
    ids = list(ctx)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(ctx) :]


@pytest.fixture(scope="module")
def tasks():
    return [load_task(PIQA), load_task(ARC_EASY)]


def test_scores_equal_brute_force_and_each_distinct_input_runs_once(model, neox, tasks):
    prepared = prepare_tasks(neox, tasks, uncond=True, limit=12)
    counter = RowCounter(model)
    scored = score_requests(counter, prepared.requests, max_len=128, batch_tokens=1024)

    brute = [brute_force(model, c, k, 128, greedy=True) for c, k in prepared.requests]
    expected, greedy = np.array([b[0] for b in brute]), np.array([b[1] for b in brute])
    np.testing.assert_allclose(scored.logprob, expected, rtol=0, atol=2e-4)
    assert (scored.greedy == greedy).all()

    # lm-eval's is_greedy, true too: continuations that are the random model's own two greedy tokens.
    own = [(c, greedy_tokens(model, c, 2)) for c, _ in prepared.requests[:6]]
    for share in (False, True):
        top = score_requests(model, own + prepared.requests[:6], max_len=128, share_contexts=share).greedy
        assert top.tolist() == [True] * 6 + greedy[:6].tolist()
    assert (scored.num_tokens == [len(k) for _, k in prepared.requests]).all()

    inputs = {tuple((list(c) + list(k))[:-1]) for c, k in prepared.requests}
    maximal = [s for s in inputs if not any(len(o) > len(s) and o[: len(s)] == s for o in inputs)]
    assert scored.forward_rows == counter.rows == len(maximal) < len(inputs) < len(prepared.requests)
    # 24 piqa+arc questions: one context each, plus the unconditional "Answer:" they all share
    assert prepared.distinct_contexts == 24 + 1

    # Our OLMo shares contexts: each distinct context and each distinct continuation (but its last
    # token) runs once; a context is repeated only where its continuations fill more than a row (packed)
    # or a batch (exact): here the unconditional "Answer:", shared by all 24 questions.
    distinct = {(tuple(c), tuple(k)) for c, k in prepared.requests}
    needed = sum(len(c) for c in {c for c, _ in distinct}) + sum(len(k) - 1 for _, k in distinct)
    for batching in ("exact", "packed"):
        engine = EngineLike(model)
        shared = score_requests(engine, prepared.requests, max_len=128, batch_tokens=1024, batching=batching)
        np.testing.assert_allclose(shared.logprob, expected, rtol=0, atol=2e-4)
        assert (shared.greedy == greedy).all()
        run = shared.forward_tokens - shared.padding_tokens
        assert needed <= run < scored.forward_tokens - scored.padding_tokens
        if batching == "exact":
            # Each context runs once, but "Answer:": its 24 questions' continuations need more than one
            # batch of 1024 tokens, and it runs once per batch.
            answer = next(c for c, _ in prepared.requests if neox.decode(c).strip() == "Answer:")
            repeats = engine.context_rows - len({tuple(c) for c, _ in prepared.requests})
            assert repeats > 0 and run == needed + repeats * len(answer)
        else:  # rows of one width in batches of one shape
            assert run - needed < 10
            assert engine.rows == shared.forward_rows and shared.forward_tokens % shared.forward_rows == 0


def test_metrics_follow_from_the_scores(model, neox, tasks):
    result = evaluate_tasks(model, neox, tasks, 0, 1, max_len=128, batch_tokens=2048, uncond=True, limit=12)
    assert set(result.tasks) == {"piqa", "arc_easy"}
    for task in tasks:
        got = result.tasks[task.name]
        hits = {"acc": 0, "acc_per_token": 0, "acc_per_char": 0, "acc_per_byte": 0, "acc_uncond": 0}
        bpb = 0.0
        for q in task.questions[:12]:
            conts = [k for _, k in q.choices]
            lp = np.array([brute_force(model, neox.encode(c), neox.encode(k), 128) for c, k in q.choices])
            ulp = np.array([brute_force(model, neox.encode(c), neox.encode(k), 128) for c, k in q.uncond])
            ntok = np.array([len(neox.encode(k)) for k in conts])
            hits["acc"] += np.argmax(lp) == q.gold
            hits["acc_per_token"] += np.argmax(lp / ntok) == q.gold
            hits["acc_per_char"] += np.argmax(lp / [len(k) for k in conts]) == q.gold
            hits["acc_per_byte"] += np.argmax(lp / [len(k.encode()) for k in conts]) == q.gold
            hits["acc_uncond"] += np.argmax(lp - ulp) == q.gold
            bpb += -lp[q.gold] / math.log(2) / len(conts[q.gold].encode())
        for m, h in hits.items():
            assert got[m] == pytest.approx(h / 12), (task.name, m)
            assert 0.0 <= got[m] <= 1.0
        assert got["primary"] == got[task.primary_metric]
        assert got["bits_per_byte_corr"] == pytest.approx(bpb / 12, rel=1e-5)
        assert got["num_questions"] == 12 and got["truncated_contexts"] == 0
    assert result.stats["scored_tokens_per_second"] > 0


def test_long_contexts_are_truncated_from_the_left_and_counted(model, neox, tasks):
    prepared = prepare_tasks(neox, tasks[1:], limit=6)
    max_len = 16
    scored = score_requests(model, prepared.requests, max_len=max_len, batch_tokens=512)
    expected = np.array([brute_force(model, c, k, max_len) for c, k in prepared.requests])
    np.testing.assert_allclose(scored.logprob, expected, rtol=0, atol=2e-4)
    too_long = [len(c) + len(k) - 1 > max_len for c, k in prepared.requests]
    assert scored.truncated.tolist() == too_long and 0 < sum(too_long) < len(too_long)

    result = evaluate_tasks(model, neox, tasks[1:], 0, 1, max_len=max_len, limit=6)
    assert result.tasks["arc_easy"]["truncated_contexts"] == sum(too_long) == result.stats["truncated_contexts"]


def test_continuation_longer_than_the_window_is_an_error(model, neox, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"context": "Q:", "choices": [" yes", " no " * 40], "gold": 0}) + "\n")
    with pytest.raises(ValueError, match=r"long.jsonl:1: continuation of \d+ tokens does not fit the model's window of 16"):
        evaluate_tasks(model, neox, [load_task(path)], 0, 1, max_len=16)


def test_trailing_context_whitespace_moves_to_the_continuation(model, neox, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"context": "The capital of France is ", "choices": ["Paris", "Rome"], "gold": 0}) + "\n")
    b.write_text(json.dumps({"context": "The capital of France is", "choices": [" Paris", " Rome"], "gold": 0}) + "\n")
    ra = evaluate_tasks(model, neox, [load_task(a)], 0, 1, max_len=128).tasks["a"]
    rb = evaluate_tasks(model, neox, [load_task(b)], 0, 1, max_len=128).tasks["b"]
    assert ra["bits_per_byte_corr"] == rb["bits_per_byte_corr"]


def test_acc_per_char_divides_by_the_characters_scored(model, neox, tmp_path):
    """docs/evaluation.md's rule: the characters of the continuation as scored, the space moved from the
    context included ("Answer: " + "Paris" divides by 6), not those of the choice as written (lm-eval's
    acc_norm under its default target_delimiter " "). Checked on the questions where the two disagree, each
    given as gold the choice the rule picks: every one counts under the rule, none under the other divisor."""
    def write(path, questions, golds):
        path.write_text("".join(json.dumps({"context": q.choices[0][0] + " ", "choices": [k.lstrip() for _, k in q.choices], "gold": int(g)}) + "\n"
                                for q, g in zip(questions, golds)))
        return load_task(path)

    arc = load_task(ARC_EASY).questions[:120]
    task = write(tmp_path / "all.jsonl", arc, [q.gold for q in arc])
    lp = score_requests(model, prepare_tasks(neox, [task]).requests, max_len=128).logprob
    picked, golds = [], []
    for original, q in zip(arc, task.questions):
        scores, lp = lp[: len(q.choices)], lp[len(q.choices) :]
        as_scored = np.argmax(scores / [len(" " + k) for _, k in q.choices])
        as_written = np.argmax(scores / [len(k) for _, k in q.choices])
        if as_scored != as_written:
            picked.append(original)
            golds.append(as_scored)
    assert picked, "no question where the two divisors disagree; take more questions"
    result = evaluate_tasks(model, neox, [write(tmp_path / "picked.jsonl", picked, golds)], 0, 1, max_len=128).tasks["picked"]
    assert result["acc_per_char"] == 1.0
