"""`batching: packed` (fixed-shape rows, contexts and continuations packed) against `exact` (the earlier
path, kept as the reference) on the real arc_easy and piqa requests, fp32 on CPU: every request's
log-likelihood within 1e-4, the same greedy flags, identical accuracies; perplexity the same; and the
packing plan's promises (one batch shape, every item once, rows no wider than the budget)."""

import numpy as np
import pytest
import torch

from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.packing import plan_packed
from olmo_ds.eval.perplexity import evaluate_perplexity, load_source, token_byte_lengths, window_batches
from olmo_ds.eval.tasks import load_task

from eval_testlib import ARC_EASY, C4, PIQA, tiny_olmo

torch.set_num_threads(1)

METRICS = ("acc", "acc_per_token", "acc_per_char", "acc_per_byte", "acc_uncond", "primary", "num_questions", "truncated_contexts")


@pytest.fixture(scope="module")
def prepared(neox):
    return prepare_tasks(neox, [load_task(ARC_EASY), load_task(PIQA)], uncond=True, limit=25)


@pytest.mark.parametrize("max_len", [256, 40], ids=["fits", "truncated"])
def test_packed_equals_exact_per_request_and_in_every_accuracy(neox, prepared, max_len):
    model = tiny_olmo(neox.vocab_size, max_seq_len=256)
    prepared = prepared if max_len == 256 else prepare_tasks(neox, [load_task(ARC_EASY)], uncond=True, limit=25)
    exact = evaluate_tasks(model, neox, prepared, 0, 1, max_len=max_len, batch_tokens=2048, batching="exact")
    packed = evaluate_tasks(model, neox, prepared, 0, 1, max_len=max_len, batch_tokens=2048, batching="packed")
    for task, ref in exact.tasks.items():
        for metric in METRICS:
            assert packed.tasks[task][metric] == ref[metric], (task, metric)
        assert packed.tasks[task]["bits_per_byte_corr"] == pytest.approx(ref["bits_per_byte_corr"], abs=1e-6)
    assert (exact.stats["truncated_contexts"] > 0) == (max_len == 40)

    a = score_requests(model, prepared.requests, max_len=max_len, batch_tokens=2048, batching="exact")
    b = score_requests(model, prepared.requests, max_len=max_len, batch_tokens=2048, batching="packed")
    assert np.abs(a.logprob - b.logprob).max() < 1e-4
    assert (a.greedy == b.greedy).all() and (a.truncated == b.truncated).all()

    st = packed.stats
    assert st["batching"] == "packed" and st["requests"] == len(prepared.requests)
    assert st["request_tokens"] == sum(len(c) + len(k) for c, k in prepared.requests)
    for key in ("requests_per_second", "request_tokens_per_second", "forward_tokens_per_second"):
        assert st[key] > 0
    # Packed runs fewer positions than the exact path pads its continuation batches to.
    assert st["forward_tokens"] < exact.stats["forward_tokens"]


def test_exact_splits_a_context_shared_by_many_questions_into_batches_within_the_budget(neox, prepared):
    """The unconditional context ("Answer:") is shared by every question's choices: on the exact path its
    continuations are split over batches, each forward within `batch_tokens`, scores as one row each."""
    model = tiny_olmo(neox.vocab_size, max_seq_len=256)
    uncond = [r for r in prepared.requests if neox.decode(r[0]).strip() == "Answer:"]
    assert len(uncond) >= 100 and len({tuple(c) for c, _ in uncond}) == 1
    shapes = []
    hook = model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    try:
        split = score_requests(model, uncond, max_len=256, batch_tokens=128, batching="exact")
    finally:
        hook.remove()
    assert len(shapes) > 2 and all(b * t <= 128 for b, t in shapes), shapes
    rows = score_requests(model, uncond, max_len=256, batch_tokens=128, share_contexts=False)
    assert np.abs(split.logprob - rows.logprob).max() < 1e-4
    assert (split.greedy == rows.greedy).all()


def test_perplexity_packed_equals_exact(neox):
    model = tiny_olmo(neox.vocab_size)
    table = token_byte_lengths(neox)
    tokens = load_source(str(C4[0]), neox, max_tokens=2000).tokens
    batches = window_batches(tokens, 128, 3)  # the last batch has fewer rows and a shorter last row
    assert batches[-1]["input_ids"].shape[0] < 3
    exact = evaluate_perplexity(model, batches, table, batching="exact")
    packed = evaluate_perplexity(model, batches, table, batching="packed")
    assert (packed.tokens, packed.bytes, packed.text_tokens, packed.rows) == (exact.tokens, exact.bytes, exact.text_tokens, exact.rows)
    assert packed.ce_loss == pytest.approx(exact.ce_loss, abs=1e-6)
    assert packed.bits_per_byte == pytest.approx(exact.bits_per_byte, abs=1e-6)
    assert packed.forward_tokens == len(batches) * 3 * 128 > exact.forward_tokens  # the last batch topped up to 3 rows
    assert packed.rows_per_second > 0 and packed.forward_tokens_per_second > 0
    with pytest.raises(ValueError, match="batching must be one of packed, exact"):
        evaluate_perplexity(model, batches, table, batching="bucketed")


def test_the_plan_has_one_batch_shape_and_scores_every_item_once(prepared):
    items = list(dict.fromkeys((tuple(c), tuple(k)) for c, k in prepared.requests))
    plan = plan_packed(items, batch_tokens=2048)
    assert plan.row_len == 512 and plan.rows_per_batch == 4  # a quarter of the budget, a power of two
    shapes = {tuple(b.input_ids.shape) for b in plan.batches}
    assert shapes == {(plan.rows_per_batch, plan.row_len)} and len(plan.batches) > 1
    scored = np.concatenate([b.items for b in plan.batches])
    assert sorted(scored.tolist()) == list(range(len(items)))
    for b in plan.batches:
        assert (b.doc_lens.sum(1) == plan.row_len).all()
        lengths = np.diff(np.append(b.starts, len(b.targets)))
        assert lengths.tolist() == [len(items[i][1]) for i in b.items]
        assert b.targets.tolist() == [t for i in b.items for t in items[i][1]]
    # Each context once and each continuation but its last token, except that a group longer than a row is
    # split with its context repeated: here the unconditional "Answer:", shared by all 50 questions' choices.
    needed = sum(len(c) for c in {c for c, _ in items}) + sum(len(k) - 1 for _, k in items)
    answer = min((c for c, _ in items), key=len)
    assert plan.tokens > needed and (plan.tokens - needed) % len(answer) == 0
    small = plan_packed(items, batch_tokens=256, min_row=64)
    assert small.row_len == 128 and all(b.input_ids.shape == (2, 128) for b in small.batches)  # the longest item decides
    assert small.tokens > plan.tokens
    assert plan_packed(items, batch_tokens=2048).batches[0].input_ids.equal(plan.batches[0].input_ids)  # deterministic
