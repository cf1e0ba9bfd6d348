"""GRPO's exactness, CPU fp32 (issue 52): a fixed set of rollouts (prompts + sampled completions, packed into rows
as the rollout phase packs them) through our model's logits, `sampled_logprobs` and `grpo_loss`, against
transformers' Olmo3ForCausalLM on the same weights run on each sample alone with the formulas written out in
float64 (open-instruct's OlmoRL, grpo_utils.py `compute_grpo_loss`): the step's token-mean loss and every
parameter's gradient within 1e-5, for clip on/off, truncated importance sampling on/off, KL on/off."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.hf import to_hf_state_dict
from olmo_ds.model.loss import IGNORE_INDEX, grpo_loss, sampled_logprobs
from olmo_ds.data.dataset import Prompt
from olmo_ds.train.rl.rollout import Sample, pack_rows

from model_testlib import OLMO3_TINY, hf_model_from, random_model

SEQ = 64
TEMPERATURE = 0.7
CLIP = (0.2, 0.272)
CAP = 2.0
BETA = 0.05


@functools.cache
def rollouts():
    """8 samples of 3 prompts (random ids), with the decode engine's, the old policy's and a reference's
    log-probabilities perturbed away from the model's so that clip, cap and KL all act on some tokens."""
    g = torch.Generator().manual_seed(3)
    prompts = [Prompt(torch.randint(0, 290, (n,), generator=g).tolist(), "exact_match", None, i) for i, n in enumerate((5, 9, 4))]
    samples = []
    for k in range(8):
        n = int(torch.randint(3, 12, (), generator=g))
        samples.append(Sample(prompt=k % 3, tokens=torch.randint(0, 290, (n,), generator=g).tolist(), logprobs=[0.0] * n,
                              finish="eos", text="", advantage=float(torch.randn((), generator=g))))
    return prompts, samples


def model():
    cfg = ModelConfig(**{**OLMO3_TINY, "max_seq_len": SEQ})
    return random_model(cfg, seed=1)


def perturbations(n: int):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 0.3, torch.randn(n, generator=g, dtype=torch.float64) * 0.8,
            torch.randn(n, generator=g, dtype=torch.float64) * 0.5)


def ours(clip: bool, tis: bool, kl: bool):
    """(loss, {name: grad}) through our packed rows."""
    prompts, samples = rollouts()
    rows = pack_rows(samples, prompts, SEQ, rows=2)
    m = model().train()
    logits = m(rows["input_ids"], doc_lens=rows["doc_lens"], positions=rows["positions"])
    keep = rows["labels"] != IGNORE_INDEX
    logprob, _ = sampled_logprobs(logits[keep], rows["labels"][keep], temperature=TEMPERATURE, vocab_size=m.cfg.vocab_size)
    d_old, d_sampled, d_ref = perturbations(int(keep.sum()))
    base = logprob.detach().double()
    old, sampled, ref = (base + d_old).float(), (base + d_old + d_sampled).float(), (base + d_ref).float()
    terms = grpo_loss(logprob, old, sampled, rows["advantages"][keep], ref if kl else None,
                      clip_low=CLIP[0] if clip else None, clip_high=CLIP[1] if clip else None, tis_cap=CAP if tis else None,
                      beta=BETA if kl else 0.0)
    loss = terms.loss.sum() / keep.sum()
    loss.backward()
    grads = {k: p.grad for k, p in m.named_parameters()}
    return float(loss.detach()), to_hf_state_dict(m.cfg, grads), terms


def theirs(clip: bool, tis: bool, kl: bool):
    """The same from transformers, each sample alone, the formulas in float64 token by token."""
    prompts, samples = rollouts()
    m = model()
    hf = hf_model_from(m).train()
    # the perturbations follow the packed order of the tokens: rows are first-fit in sample order, so recover it
    rows = pack_rows(samples, prompts, SEQ, rows=2)
    keep = rows["labels"] != IGNORE_INDEX
    order = []  # for each packed target position (row-major), (sample, token)
    for r in range(rows["labels"].shape[0]):
        at = 0
        lens = [int(x) for x in rows["doc_lens"][r] if x]
        for n in lens:
            for k, s in enumerate(samples):
                if k in {o[0] for o in order}:
                    continue
                seq = prompts[s.prompt].ids + s.tokens
                if len(seq) == n and torch.equal(rows["input_ids"][r, at:at + n], torch.tensor(seq)):
                    order.extend((k, i) for i in range(len(s.tokens)))
                    break
            at += n
    assert len(order) == int(keep.sum())
    d_old, d_sampled, d_ref = perturbations(len(order))
    per_sample_lp = {}
    for k, s in enumerate(samples):
        seq = torch.tensor(prompts[s.prompt].ids + s.tokens)[None]
        logits = hf(seq).logits[0].double()[:, :m.cfg.vocab_size] / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        p = len(prompts[s.prompt].ids)
        per_sample_lp[k] = logp[p - 1:-1].gather(1, torch.tensor(s.tokens)[:, None]).squeeze(1)
    total = 0.0
    for j, (k, i) in enumerate(order):
        lp = per_sample_lp[k][i]
        base = lp.detach()
        old = (base + d_old[j]).float().double()
        sampled = (base + d_old[j] + d_sampled[j]).float().double()
        ref = (base + d_ref[j]).float().double()
        a = float(torch.tensor(samples[k].advantage, dtype=torch.float32))
        ratio = torch.exp(lp - old)
        pg = -a * ratio
        if clip:
            pg = torch.maximum(pg, -a * ratio.clamp(1 - CLIP[0], 1 + CLIP[1]))
        if tis:
            pg = pg * min(math.exp(max(-10.0, min(10.0, float(old - sampled)))), CAP)
        if kl:
            dd = (lp - ref).clamp(-40, 40)
            pg = pg + BETA * (torch.exp(-dd) - 1 + dd)
        total = total + pg
    loss = total / len(order)
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in hf.named_parameters()}


@pytest.mark.parametrize("clip,tis,kl", [(True, True, False), (False, False, False), (True, False, True), (False, True, True)])
def test_loss_and_gradient_equal_transformers_and_the_formulas(clip, tis, kl):
    loss, grads, terms = ours(clip, tis, kl)
    want_loss, want_grads = theirs(clip, tis, kl)
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (loss, want_loss)
    for name, g in want_grads.items():
        if g is None:
            continue
        got = grads[name]
        scale = max(float(g.abs().max()), 1e-3)
        assert float((got.double() - g.double()).abs().max()) <= 1e-5 * scale, name
    # the settings act: some tokens clipped, some capped, KL non-zero, or not at all when off
    assert bool(terms.clipped.any()) == clip
    assert bool(terms.capped.any()) == tis
    assert bool(terms.kl.abs().sum() > 0) == kl


def test_the_check_can_fail():
    """Clipping changes the loss on these rollouts: the comparison above would see a wrong formula."""
    assert abs(ours(True, False, False)[0] - theirs(False, False, False)[0]) > 1e-4
