"""GRPO on DeepSpeed ZeRO-3, CPU (issue 52): one step (rollout + update) gives the same gradient for 1 rank x 8
micro-batches of one row, 1 rank x 1 micro-batch of 8 rows and 2 ranks x 4 micro-batches: the same samples (keyed
by step, prompt and sample wherever they are drawn), the loss a token mean over all generated tokens of the step.
And that gradient is plain autograd's on the same samples (an independent computation of the formulas). With
sequence parallelism, 2 ranks holding each row between them (1 data-parallel x 2) give one rank's step: the group
splits the drawing of its samples, and the samples, rows, gradient and metrics are those of one rank."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import OLMo
from olmo_ds.model.loss import IGNORE_INDEX

from train_testlib import run, torchrun_cmd

WORKER = __import__("pathlib").Path(__file__).with_name("rl_grad_worker.py")


def one_step(tmp_path, name, *, nproc, micro, sp=1, beta=0.0):
    out = tmp_path / f"{name}.pt"
    result = run(torchrun_cmd(WORKER, str(micro), str(out), str(sp), str(beta), nproc=nproc))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return torch.load(out, weights_only=False)


def samples(step, ranks=None) -> dict:
    """Every sample of the step (of `ranks`' rows: default all), by (prompt + the sample's tokens): its advantage,
    wherever it was packed."""
    found = {}
    for part in ranks or step["ranks"]:
        rows = part["rows"]
        for r in range(rows["input_ids"].shape[0]):
            at = 0
            for n in [int(x) for x in rows["doc_lens"][r] if x]:
                labels = rows["labels"][r, at:at + n]
                keep = labels != IGNORE_INDEX
                if keep.any():
                    ids = tuple(rows["input_ids"][r, at:at + n].tolist())
                    assert ids not in found
                    found[ids] = float(rows["advantages"][r, at:at + n][keep][0])
                at += n
    return found


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    return num / sum(float(b[k].norm() ** 2) for k in b) ** 0.5


def autograd(step) -> dict:
    """The step's gradient by plain autograd on one plain model holding the engine's starting weights: every rank's rows, the loss
    -A * ratio per token (ratio = exp(lp - lp.detach()), clip inactive at ratio 1; no importance weight),
    summed over every generated token and divided by their count."""
    cfg = step["cfg"]
    model = OLMo(cfg)
    model.load_state_dict(step["start"])
    total, count = 0.0, 0
    for part in step["ranks"]:
        rows = part["rows"]
        logits = model(rows["input_ids"], doc_lens=rows["doc_lens"], positions=rows["positions"]).double()
        keep = rows["labels"] != IGNORE_INDEX
        logp = torch.log_softmax(logits[keep][:, :cfg.vocab_size], -1).gather(1, rows["labels"][keep][:, None]).squeeze(1)
        total = total + (-rows["advantages"][keep].double() * torch.exp(logp - logp.detach())).sum()
        count += int(keep.sum())
    (total / count).backward()
    return {k: p.grad.double() for k, p in model.named_parameters()}


@pytest.mark.slow
def test_gradient_is_the_global_token_mean_whatever_the_split(tmp_path):
    acc8 = one_step(tmp_path, "m1x8", nproc=1, micro=1)
    full = one_step(tmp_path, "m8x1", nproc=1, micro=8)
    ranks = one_step(tmp_path, "r2x4", nproc=2, micro=1)
    drawn = samples(acc8)
    # the same rollouts, however the prompts were spread: the same tokens, rewards and advantages
    assert samples(full) == drawn and samples(ranks) == drawn
    assert len(drawn) + acc8["metrics"]["rollout/dropped_groups"] * 4 == 16
    assert acc8["metrics"]["rollout/dropped_groups"] < 4  # some groups train
    assert acc8["n_micro"] >= 2 and ranks["n_micro"] >= 1
    assert rel(full["grads"], acc8["grads"]) < 1e-6, rel(full["grads"], acc8["grads"])
    assert rel(ranks["grads"], acc8["grads"]) < 1e-6, rel(ranks["grads"], acc8["grads"])
    want = autograd(acc8)
    assert rel(acc8["grads"], want) < 1e-5, rel(acc8["grads"], want)
    for m in (full["metrics"], ranks["metrics"]):
        for k in ("loss", "generated_tokens", "rollout/reward_mean", "rollout/dropped_groups", "rollout/response_length_mean"):
            assert abs(m[k] - acc8["metrics"][k]) <= 1e-6 * max(1.0, abs(acc8["metrics"][k])), (k, m[k], acc8["metrics"][k])
    assert acc8["metrics"]["clip_fraction"] == 0.0  # one update per rollout: the ratio is 1


@pytest.mark.multirank
def test_a_sequence_group_trains_as_one_rank_on_the_same_samples(tmp_path):
    """1 rank against 2 ranks as 1 data-parallel x 2 sequence-parallel, each with a KL term to a reference that is
    not the policy (so the reference's log-probabilities, spread over the group, reach the gradient)."""
    one = one_step(tmp_path, "one", nproc=1, micro=1, beta=0.1)
    group = one_step(tmp_path, "sp2", nproc=2, micro=1, sp=2, beta=0.1)
    first, second = group["ranks"]
    assert first["prompts"] == second["prompts"] == [0, 1, 2, 3]  # a group's ranks hold the same prompts
    # the group split the drawing: half each, together every sample one rank drew, the same tokens
    assert len(first["drawn"]) == len(second["drawn"]) == 8 and first["drawn"] + second["drawn"] == one["ranks"][0]["drawn"]
    for k in ("input_ids", "labels", "advantages", "positions", "doc_lens"):  # and both packed the same rows
        assert torch.equal(first["rows"][k], second["rows"][k]), k
    assert samples(group, [first]) == samples(one) and len(samples(one)) >= 4
    assert group["n_micro"] == one["n_micro"] >= 2
    assert rel(group["grads"], one["grads"]) < 1e-6, rel(group["grads"], one["grads"])
    for k in ("loss", "generated_tokens", "kl", "entropy", "rollout/samples", "rollout/groups", "rollout/reward_mean",
              "rollout/dropped_groups", "rollout/response_length_mean", "rollout/truncated_fraction"):
        assert abs(group["metrics"][k] - one["metrics"][k]) <= 1e-6 * max(1.0, abs(one["metrics"][k])), (k, group["metrics"][k], one["metrics"][k])
    assert group["metrics"]["rollout/samples"] == 16 and one["metrics"]["kl"] > 0  # each sample counted once
