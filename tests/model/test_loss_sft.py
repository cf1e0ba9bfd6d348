"""Fine-tuning's loss: the mean over the trained tokens of the whole step, whatever the micro-batches
(olmo_ds/model/loss.py `divisor`, `labels_from_mask`, `global_target_count`, `token_mean_divisor`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.loss import (count_targets, fused_linear_cross_entropy, global_target_count, labels_from_mask,
                                token_mean_divisor)

from model_testlib import OLMO2_TINY, random_model
from testdata import SHARED

ROWS, T = 4, 48
# Targets per row (micro-batch of one row): one nearly empty, the rest dense, as SFT data is (3 vs 3,353 targets).
DENSITY = [2, 40, 44, 30]


def sharp_model():
    """A tiny model with a peaked output distribution, so that per-token losses differ widely."""
    model = random_model(ModelConfig(**OLMO2_TINY)).float()
    with torch.no_grad():
        model.head.weight.mul_(8)
    return model


def packed_batch(model):
    """Rows of two documents each (doc_lens), a label mask of very different densities per row; the
    sparse row's targets are the model's own most likely tokens (a low loss), the dense rows' random."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, OLMO2_TINY["vocab_size"], (ROWS, T), generator=g)
    with torch.no_grad():
        for t in range(T - DENSITY[0], T):
            ids[0, t] = model(ids[:1])[0, t - 1].argmax()
    mask = torch.zeros(ROWS, T, dtype=torch.bool)
    for r, n in enumerate(DENSITY):
        mask[r, T - n:] = True
    doc_lens = torch.tensor([[20, T - 20]] * ROWS, dtype=torch.int32)
    return ids, labels_from_mask(ids, mask), doc_lens


def hidden_of(model, ids, doc_lens):
    """The model's real forward up to the head's input (a hook on the head), graph attached."""
    seen = {}
    handle = model.head.register_forward_pre_hook(lambda module, args: seen.setdefault("h", args[0]))
    try:
        model(ids, doc_lens=doc_lens)
    finally:
        handle.remove()
    return seen["h"]


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run(model, fn):
    model.zero_grad()
    loss = fn()
    return loss, grads_of(model)


def test_step_token_mean_is_one_big_batch_and_mean_of_means_is_not():
    model = sharp_model()
    ids, labels, doc_lens = packed_batch(model)
    assert [int(count_targets(labels[r])) for r in range(ROWS)] == DENSITY

    def big_batch():  # pretraining's path over the whole step at once: the token mean
        out = model(ids, labels=labels, doc_lens=doc_lens, z_loss_coef=1e-4)
        out.loss.backward()
        return out.loss.item()

    def mean_of_means():  # pretraining's path per micro-batch, averaged (gradient accumulation today)
        total = 0.0
        for r in range(ROWS):
            out = model(ids[r:r + 1], labels=labels[r:r + 1], doc_lens=doc_lens[r:r + 1], z_loss_coef=1e-4)
            (out.loss / ROWS).backward()
            total += out.loss.item() / ROWS
        return total

    def global_count():  # fine-tuning: each micro-batch's sum over the step's target count
        n = global_target_count([labels[r:r + 1] for r in range(ROWS)])
        assert int(n) == sum(DENSITY)
        total = 0.0
        for r in range(ROWS):
            h = hidden_of(model, ids[r:r + 1], doc_lens[r:r + 1])
            loss, _, _ = fused_linear_cross_entropy(h, model.head.weight, labels[r:r + 1], 1e-4, divisor=n)
            loss.backward()
            total += loss.item()
        return total

    ref, ref_grads = run(model, big_batch)
    mom, mom_grads = run(model, mean_of_means)
    glob, glob_grads = run(model, global_count)
    print(f"\ntoken mean {ref:.7f}, mean of micro-batch means {mom:.7f}, sum / global count {glob:.7f}")
    assert abs(mom - ref) > 0.01 * ref  # the sparse micro-batch's 2 targets weigh as much as a dense one's 44
    assert abs(glob - ref) < 1e-6 * ref
    worst = max(((glob_grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item() for k in ref_grads)
    wrong = max(((mom_grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item() for k in ref_grads)
    assert worst < 1e-6 and wrong > 1e-2, (worst, wrong)


def test_divisor_under_deepspeed_scaling_gives_the_token_mean():
    """2 ranks x 2 accumulation steps, simulated the way DeepSpeed scales: engine.backward divides each
    loss by the accumulation steps, and the ranks' gradients are averaged."""
    model = sharp_model()
    ids, labels, doc_lens = packed_batch(model)
    ref, ref_grads = run(model, lambda: model(ids, labels=labels, doc_lens=doc_lens).loss.backward())
    world, gas = 2, 2
    divisor = token_mean_divisor(global_target_count(labels), world_size=world, accumulation_steps=gas)
    rank_grads, logged = [], []
    for rank in range(world):
        model.zero_grad()
        for step in range(gas):
            r = rank * gas + step
            h = hidden_of(model, ids[r:r + 1], doc_lens[r:r + 1])
            loss, ce, _ = fused_linear_cross_entropy(h, model.head.weight, labels[r:r + 1], divisor=divisor)
            (loss / gas).backward()
            logged.append(ce.item())
        rank_grads.append(grads_of(model))
    big = model(ids, labels=labels, doc_lens=doc_lens)
    assert abs(sum(logged) / (world * gas) - big.ce_loss.item()) < 1e-6  # the trainer's logging: mean over micro-batches and ranks
    for k, want in ref_grads.items():
        got = (rank_grads[0][k] + rank_grads[1][k]) / world
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6, k


def test_every_token_trained_matches_the_old_mean_exactly():
    """Pretraining (all tokens trained): divisor = the count gives the old mean bit for bit, and on
    equal micro-batches the step's token mean is the old mean of means."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 16, 32, generator=g)
    weight = torch.randn(100, 32, generator=g) * 0.3
    labels = torch.randint(0, 100, (4, 16), generator=g)
    results = []
    for divisor in (None, count_targets(labels), float(labels.numel())):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, ce, z = fused_linear_cross_entropy(h, w, labels, 1e-4, chunk_size=7, divisor=divisor)
        loss.backward()
        results.append([loss, ce, z, h.grad, w.grad])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    means = [fused_linear_cross_entropy(hidden[i], weight, labels[i])[0] for i in range(4)]
    n = global_target_count(list(labels))
    sums = [fused_linear_cross_entropy(hidden[i], weight, labels[i], divisor=n)[0] for i in range(4)]
    torch.testing.assert_close(torch.stack(sums).sum(), torch.stack(means).mean(), rtol=1e-6, atol=0)


def test_target_mask_and_plain_sums():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (10,), generator=g)
    keep = torch.tensor([True, False] * 5)
    masked = fused_linear_cross_entropy(hidden, weight, labels, target_mask=keep)[0]
    ignored = fused_linear_cross_entropy(hidden, weight, labels.masked_fill(~keep, -100))[0]
    assert torch.equal(masked, ignored)
    total = fused_linear_cross_entropy(hidden, weight, labels, divisor=1)[1]
    per_token = torch.logsumexp(hidden @ weight.t(), -1) - (hidden @ weight.t()).gather(1, labels[:, None]).squeeze(1)
    torch.testing.assert_close(total, per_token.sum())
    with pytest.raises(ValueError, match="target_mask must be bool"):
        fused_linear_cross_entropy(hidden, weight, labels, target_mask=keep.long())
    empty = fused_linear_cross_entropy(hidden, weight, torch.full((10,), -100), divisor=token_mean_divisor(0))
    assert empty[0].item() == 0.0


def test_labels_from_mask_on_olmocore_sample():
    """OLMo-core's rule: position t predicts t + 1 exactly when label_mask[t + 1]; nothing is predicted
    across a conversation start, since a conversation's first token is never a target."""
    root = SHARED / "data" / "olmocore-sft-sample"
    ids = torch.from_numpy(np.fromfile(root / "token_ids_part_0000.npy", dtype=np.uint32).astype(np.int64))
    mask = torch.from_numpy(np.fromfile(root / "labels_mask_part_0000.npy", dtype=np.bool_))
    index = [json.loads(line) for line in (root / "sample_index.jsonl").read_text().splitlines()]
    labels = labels_from_mask(ids[None], mask[None])[0]
    assert int(count_targets(labels)) == int(mask[1:].sum()) == 36_995
    torch.testing.assert_close(labels[:-1][mask[1:]], ids[1:][mask[1:]])
    ends = torch.tensor([r["end"] for r in index[:-1]])
    assert (labels[ends - 1] == -100).all()  # the EOS of one conversation does not predict the next one's start
    with pytest.raises(ValueError, match="label_mask must be bool"):
        labels_from_mask(ids[None], mask[None].long())
