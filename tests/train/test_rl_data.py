"""What a rollout does with its samples before packing (issue 58), on fixed samples: truncated samples kept, masked
or penalised; a group whose log-probabilities are not finite dropped; active sampling's choice of the first groups
with signal; the samples files' schedule, contents and rotation; the new `rl:` keys' refusals."""

from __future__ import annotations

import json
import math

import pytest

from olmo_ds.data.dataset import Prompt
from olmo_ds.train.config import ConfigError, RLConfig
from olmo_ds.train.rl.grpo import RLObjective
from olmo_ds.train.rl.rollout import Sample, group_advantages, score_samples
from olmo_ds.train.rl.samples_log import prune_samples, wanted, write_samples

import torch

PROMPTS = [Prompt([1, 2], "v", None, 10), Prompt([3], "v", None, 11)]


def samples(finishes, texts, logprob=-1.0):
    return [Sample(prompt=k // 2, index=k % 2, tokens=[5, 6], logprobs=[logprob, logprob], finish=f, text=t)
            for k, (f, t) in enumerate(zip(finishes, texts))]


def by_text(verifier, text, ground_truth):
    return float(text == "right")


@pytest.mark.parametrize("policy, rewards, trained", [("keep", [1.0, 0.0, 1.0, 0.0], [True] * 4),
                                                      ("mask", [1.0, 0.0, 1.0, 0.0], [True, False, True, True]),
                                                      ("penalty", [1.0, -1.0, 1.0, 0.0], [True] * 4)])
def test_truncated_samples_are_kept_masked_or_penalised(policy, rewards, trained):
    s = samples(["eos", "length", "stop", "eos"], ["right", "wrong", "right", "wrong"])
    score_samples(s, PROMPTS, by_text, truncated=policy, truncated_reward=-1.0)
    assert [x.reward for x in s] == rewards and [x.score for x in s] == [1.0, 0.0, 1.0, 0.0]
    assert [x.trained for x in s] == trained
    groups = group_advantages(s, PROMPTS, samples_per_prompt=2, normalize_std=False)
    assert [x.advantage for x in s] == ([1.0, -1.0, 0.5, -0.5] if policy == "penalty" else [0.5, -0.5, 0.5, -0.5])
    # a masked sample still counts in its group's mean (its partner's advantage is 0.5), but is not packed
    assert [groups.kept.index(x) if x in groups.kept else None for x in s] == \
           ([0, None, 1, 2] if policy == "mask" else [0, 1, 2, 3])


def test_a_group_with_non_finite_logprobs_is_dropped_and_counted():
    s = samples(["eos"] * 4, ["right", "wrong", "right", "wrong"])
    s[3].logprobs = [-1.0, math.nan]
    score_samples(s, PROMPTS, by_text)
    groups = group_advantages(s, PROMPTS, samples_per_prompt=2, normalize_std=False)
    assert groups.kept == s[:2] and groups.nonfinite == 1 and groups.dropped == 1
    assert [x.dropped for x in s] == [None, None, "non-finite log-probabilities", "non-finite log-probabilities"]


def test_active_sampling_keeps_the_first_groups_with_signal_in_global_order():
    rl = RLConfig(samples_per_prompt=2, active_sampling_draws=2)
    objective = RLObjective(rl, seq_len=64, micro_batch=1, world_size=1, vocab_size=100, device=torch.device("cpu"))
    # two draws of 2 prompts: groups 0 (no signal), 1, 2, 3 with signal; a batch of 2 takes 1 and 2
    s = samples(["eos"] * 8, ["x", "x", "right", "x", "right", "x", "right", "x"])
    for k, x in enumerate(s):
        x.prompt = k // 2
    prompts = PROMPTS + [Prompt([4], "v", None, 12), Prompt([5], "v", None, 13)]
    score_samples(s, prompts, by_text)
    groups = group_advantages(s, prompts, samples_per_prompt=2, normalize_std=False)
    assert objective._keep_first(groups, 2, 2) == 1
    assert [x.dropped for x in s[::2]] == ["no signal", None, None, "surplus"]


def test_samples_files_schedule_contents_and_rotation(tmp_path):
    assert [s for s in range(1, 31) if wanted(s, 10)] == [1, 2, 3, 4, 5, 10, 20, 30]
    assert not any(wanted(s, 0) for s in range(1, 31))
    for step in (1, 2, 3, 10, 20, 30):
        write_samples(tmp_path, step, [{"step": step, "completion": "é"}])
    assert json.loads((tmp_path / "samples" / "step-0000030.jsonl").read_text()) == {"step": 30, "completion": "é"}
    assert prune_samples(tmp_path, keep_last=2) == []  # no checkpoints yet: nothing rotates
    for step in (10, 20, 30):
        d = tmp_path / "checkpoints" / f"step-{step:07d}"
        d.mkdir(parents=True)
        (d / "train_state.json").write_text("{}")
    removed = prune_samples(tmp_path, keep_last=2, keep_every=3)  # before step 20 (the older of the newest two) go, but 3
    assert sorted(p.name for p in removed) == ["step-0000001.jsonl", "step-0000002.jsonl", "step-0000010.jsonl"]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step-0000003.jsonl", "step-0000020.jsonl", "step-0000030.jsonl"]


@pytest.mark.parametrize("key, value, message", [
    ("top_p", 0.0, r"rl.top_p must be in \(0, 1\]"), ("stop", [""], "rl.stop must be a list of non-empty strings"),
    ("stop", "\n", "rl.stop must be a list"), ("truncated", "drop", "rl.truncated 'drop' is not one of keep, mask, penalty"),
    ("active_sampling_draws", -1, "rl.active_sampling_draws must be an integer >= 0"),
    ("samples_every", 1.5, "rl.samples_every must be an integer >= 0"), ("verifier_timeout", 0, "rl.verifier_timeout must be > 0")])
def test_the_new_rl_keys_are_refused_when_wrong(key, value, message):
    with pytest.raises(ConfigError, match=message):
        RLConfig(**{key: value}).validate("run.yaml")
