"""RL trains the same updates on 1 rank and on 2 (issue 58): through `scripts/pretrain.py`, IFEval prompts from
`make_rl_prompts.py` prepared with `prepare_data.py --format rl`, a random tiny model with the dolma2 vocabulary
(a near-uniform distribution over 100K ids at temperature 1: any rounding that depended on the decode batch would
draw other tokens), two steps. Each step's samples (every token, from the samples files), loss and gradient norm,
and the weights after the last step agree between the layouts: the samples exactly, the numbers within 1e-5. The
layouts split the groups differently, and in step 2 one rank keeps no group (every one of its prompts' groups is
dropped: `rollout/dropped_groups`), with one update per rollout and without KL, and with two updates and KL."""

from __future__ import annotations

import json

import pytest
import torch

from olmo_ds.weights import load_weights

from train_testlib import DOLMA2, ROOT, read_metrics, rl_inputs, run, tiny_config, torchrun_cmd, write_config

TOKENIZER = str(DOLMA2)
SEQ = 320
MODEL = {"preset": "tiny", "d_model": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden": 128, "max_seq_len": 1024}


@pytest.fixture(scope="module")
def prompts_and_model(tmp_path_factory):
    return rl_inputs(tmp_path_factory.mktemp("rl-ranks"), count=200, max_tokens=256, model=MODEL, val_fraction=0.1)


def train(tmp_path, data, init, name: str, nproc: int, rl: dict):
    cfg = tiny_config(tmp_path, data, **{
        "run_dir": str(tmp_path / name), "max_steps": 2, "model": MODEL, "init_from": {"path": str(init)}, "tokenizer": TOKENIZER,
        "batch": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": SEQ},
        "optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0}, "schedule": {"kind": "constant", "warmup_steps": 0},
        "rl": {"samples_per_prompt": 8, "max_new_tokens": 24, "generation_batch_size": 32, "tis_cap": 0, **rl},
        "checkpoint": {"every": 0, "keep_last": 2}, "logging": {"every": 1, "tensorboard": False}})
    result = run(torchrun_cmd(ROOT / "scripts" / "pretrain.py", "--config", str(write_config(tmp_path / f"{name}.yaml", cfg)), nproc=nproc))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    run_dir = tmp_path / name
    samples = [[json.loads(line) for line in (run_dir / "samples" / f"step-{s:07d}.jsonl").read_text().splitlines()] for s in (1, 2)]
    weights = load_weights(sorted((run_dir / "checkpoints").glob("step-*"))[-1]).state_dict
    return read_metrics(run_dir), samples, weights


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("rl", [{"beta": 0.0, "seed": 3}, {"beta": 0.1, "updates_per_rollout": 2, "seed": 3}], ids=["plain", "kl-2-updates"])
def test_one_rank_and_two_train_the_same_samples_losses_and_weights(tmp_path, prompts_and_model, rl):
    data, init = prompts_and_model
    one = train(tmp_path, data, init, "one", 1, rl)
    two = train(tmp_path, data, init, "two", 2, rl)
    for step in range(2):
        assert [(r["prompt_index"], r["sample"], r["completion"], r["reward"], r["dropped"]) for r in one[1][step]] == \
               [(r["prompt_index"], r["sample"], r["completion"], r["reward"], r["dropped"]) for r in two[1][step]]
        a, b = one[0][step], two[0][step]
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rl/generated_tokens"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (step + 1, key)
    # in some step one rank (2 of the global batch's 4 prompts each, in order) kept no group and the other did
    def halves(records):
        order = list(dict.fromkeys(r["prompt_index"] for r in records))
        kept = {r["prompt_index"] for r in records if r["dropped"] is None}
        return [bool(kept & set(order[:2])), bool(kept & set(order[2:]))]
    assert any(sorted(halves(step)) == [False, True] for step in one[1]), [halves(step) for step in one[1]]
    for name, w in one[2].items():
        assert torch.allclose(w, two[2][name], atol=1e-5, rtol=0), name
    assert any((one[2][n] - w0).abs().max() > 1e-4 for n, w0 in load_weights(init).state_dict.items())  # the steps moved it


@pytest.mark.slow
@pytest.mark.multirank
def test_one_actor_and_two_learners_train_what_two_colocated_ranks_train(tmp_path, prompts_and_model):
    """`rl.actor_ranks 1` on 3 ranks: the third rank only generates (weights broadcast to it each step), the two
    learners train; samples, rewards, losses, gradient norms and the final weights are the 2-rank colocated run's,
    exactly (samples are keyed by step, prompt and sample; decoding on CPU is batch-invariant)."""
    data, init = prompts_and_model
    rl = {"beta": 0.0, "seed": 3}
    two = train(tmp_path, data, init, "two", 2, rl)
    actors = train(tmp_path, data, init, "actors", 3, {**rl, "actor_ranks": 1})
    for step in range(2):
        assert [(r["prompt_index"], r["sample"], r["completion"], r["reward"], r["logprob_mean"]) for r in two[1][step]] == \
               [(r["prompt_index"], r["sample"], r["completion"], r["reward"], r["logprob_mean"]) for r in actors[1][step]]
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rl/generated_tokens"):
            assert two[0][step][key] == actors[0][step][key], (step + 1, key)
        assert actors[0][step]["time/actor_wait_s"] > 0
    for name, w in two[2].items():
        assert torch.equal(w, actors[2][name]), name


@pytest.mark.slow
@pytest.mark.multirank
def test_an_actor_decodes_ahead_of_two_learners_with_async_steps(tmp_path, prompts_and_model):
    """`rl.actor_ranks 1` with `rl.async_steps 1`: the actor decodes step 2's samples while the learners train step 1,
    under step 1's weights, and swaps in step 2's when they come; no sample trains more than one version after it
    started, and some of step 2's did start a version early (its first samples take slots freed during step 1)."""
    data, init = prompts_and_model
    metrics, samples, _ = train(tmp_path, data, init, "async", 3, {"beta": 0.0, "seed": 3, "actor_ranks": 1, "async_steps": 1})
    staleness = [[r["step"] - 1 - r["versions"][0] for r in step] for step in samples]  # a step trains version step - 1
    assert all(0 <= x <= 1 for step in staleness for x in step), staleness
    assert max(staleness[1]) == 1 and metrics[1]["rollout/staleness_max"] == 1
    for m in metrics:
        assert 0 < m["rollout/occupancy"] <= 1 and m["time/actor_wait_s"] >= 0 and m["train/loss"] == m["train/loss"]
