"""GRPO end to end on CPU through the real command line (issue 52): prompts written by scripts/make_rl_prompts.py,
prepared by scripts/prepare_data.py --format rl (OLMo 3's template, the dolma2 tokenizer), trained by
scripts/pretrain.py from a starting model with a KL penalty to it; every step logs the rollout, the loss terms
and the time split, in-loop evaluation the greedy solve rate; a resume from the step-2 checkpoint draws the same
samples and gives the same rewards and losses, bit for bit. And the rollout's pieces on their own: advantages,
dropped groups, packed rows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from olmo_ds.model.loss import IGNORE_INDEX
from olmo_ds.data.dataset import Prompt
from olmo_ds.train.rl.rollout import Sample, group_advantages, group_share, pack_rows, rows_needed, sample_key, score_samples, update_of

from train_testlib import ROOT, read_metrics, rl_inputs, run, tiny_config, torchrun_cmd, write_config

PRETRAIN = ROOT / "scripts" / "pretrain.py"
TOKENIZER = "/work/shared/tokenizers/dolma2-tokenizer.json"
SEQ = 160
MODEL = {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64, "max_seq_len": SEQ}


@pytest.fixture(scope="module")
def prompts_and_model(tmp_path_factory):
    """IFEval-style prompts prepared with a validation split, and a random tiny model with the tokenizer's vocabulary."""
    return rl_inputs(tmp_path_factory.mktemp("rl"), count=60, max_tokens=128, model=MODEL, val_fraction=0.1)


def rl_config(tmp_path, data, init, **sections) -> dict:
    return tiny_config(tmp_path, data, **{"max_steps": 4, "model": MODEL, "init_from": {"path": str(init)}, "tokenizer": TOKENIZER,
                                          "batch": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": SEQ},
                                          "optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0},
                                          "schedule": {"kind": "constant", "warmup_steps": 0},
                                          "rl": {"samples_per_prompt": 4, "max_new_tokens": 16, "beta": 0.1, "seed": 5},
                                          "checkpoint": {"every": 2, "keep_last": 2}, "logging": {"every": 1, "tensorboard": False},
                                          **sections})


def pretrain(tmp_path, cfg, name, *extra, nproc=1):
    result = run(torchrun_cmd(PRETRAIN, "--config", str(write_config(tmp_path / f"{name}.yaml", cfg)), *extra, nproc=nproc))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


ALWAYS = ("train/loss", "train/rows", "rollout/prompts", "rollout/samples", "rollout/trained_samples", "rollout/reward_mean",
          "rollout/reward_mean/ifeval", "rollout/solve_rate", "rollout/solve_rate/ifeval", "rollout/dropped_groups",
          "rollout/groups", "rollout/generated_tokens", "rollout/response_length_mean", "rollout/response_length_max",
          "rollout/truncated_fraction", "rollout/truncated_fraction/ifeval", "rl/generated_tokens", "rl/samples_seen")
# what a step measures on its trained tokens: absent from a step that trained none (every group dropped), not 0
MEASURED = ("rl/clip_fraction", "rl/importance_ratio_mean", "rl/importance_ratio_max", "rl/tis_capped_fraction", "rl/entropy", "rl/kl")
LOGGED = ALWAYS + MEASURED


@pytest.mark.slow
@pytest.mark.parametrize("updates", [1, 2])
def test_an_rl_run_logs_each_step_and_resumes_exactly(tmp_path, prompts_and_model, updates):
    data, init = prompts_and_model
    cfg = rl_config(tmp_path, data, init, eval={"every": 2})
    cfg["rl"]["updates_per_rollout"] = updates
    log = pretrain(tmp_path, cfg, "rl")
    straight = tmp_path / "run"
    rows = read_metrics(straight)
    steps = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    for r in steps.values():
        for key in (*ALWAYS, "time/gather_s", "time/generation_s", "time/reward_s", "time/training_s"):
            assert key in r, key
        for key in MEASURED:
            assert (key in r) == (r["rl/generated_tokens"] > 0), (r["step"], key)
        assert "train/ppl" not in r and "train/global_batch_size" not in r  # GRPO's loss has no perplexity; rows are not prompts
        assert r["rollout/groups"] == 4 and r["rollout/prompts"] == 4 and r["rl/samples_seen"] % 16 == 0
        assert 0 < r["rollout/response_length_mean"] <= 16 and r["time/generation_s"] > 0
        assert r["rollout/generated_tokens"] >= r["rl/generated_tokens"]
        samples = [json.loads(line) for line in (straight / "samples" / f"step-{r['step']:07d}.jsonl").read_text().splitlines()]
        assert len(samples) == 16 and sum(x["trained"] for x in samples) == r["rollout/trained_samples"]
        assert sum(x["length"] for x in samples if x["trained"]) == r["rl/generated_tokens"]
        assert sum(x["length"] for x in samples) == r["rollout/generated_tokens"]
        assert {x["update"] for x in samples} == set(range(updates)) and all(x["verifier"] == "ifeval" for x in samples)
    assert any(r["rollout/dropped_groups"] < 4 for r in steps.values())  # some groups had a reward spread and trained
    assert steps[1].get("rl/kl", 0.0) == 0.0  # the policy starts as the reference
    assert any(r.get("rl/kl", 0.0) > 0 for r in steps.values() if r["step"] > 1)
    evals = [r for r in rows if "eval/data/solve_rate" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert "reward" in log and "eval step 2 | data/solve_rate" in log
    if updates > 1:  # the ratio to the policy that sampled: 1 on update 1, off 1 where update 2 trains; each update's own
        assert all("time/old_logprobs_s" in r for r in steps.values())
        assert any(r.get("rl/policy_ratio_mean", 1.0) != 1.0 for r in steps.values())
        for r in steps.values():
            assert r["rl/update_1/generated_tokens"] + r["rl/update_2/generated_tokens"] == r["rl/generated_tokens"]
            assert "rl/update_1/grad_norm" in r and "rl/update_2/grad_norm" in r
    else:
        assert not any("rl/policy_ratio_mean" in r or "time/old_logprobs_s" in r for r in steps.values())

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    pretrain(tmp_path, {**cfg, "run_dir": str(resumed)}, "resumed", "--resume", "auto")
    got = {r["step"]: r for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in (*LOGGED, "train/grad_norm", *(("rl/policy_ratio_mean",) if updates > 1 else ())):
            assert got[step].get(key) == steps[step].get(key), (step, key, got[step].get(key), steps[step].get(key))


@pytest.mark.slow
@pytest.mark.multirank
def test_an_rl_run_over_a_sequence_group_steps_as_over_data_parallel_ranks(tmp_path, prompts_and_model):
    """2 ranks through pretrain.py as 1 data-parallel x 2 sequence-parallel and as 2 x 1: the same prompts a step,
    so the same samples, rewards, loss and KL (with the default importance weight, whose decode log-probabilities
    differ across batchings by ~1e-7), each sample counted once; in-loop evaluation over both ranks' prompts."""
    data, init = prompts_and_model
    runs = {}
    for sp in (1, 2):
        cfg = rl_config(tmp_path / f"sp{sp}", data, init, max_steps=2, eval={"every": 2}, parallel={"sequence_parallel_size": sp},
                        checkpoint={"every": 0, "save_final": False})
        log = pretrain(tmp_path, cfg, f"sp{sp}", nproc=2)
        runs[sp] = read_metrics(tmp_path / f"sp{sp}" / "run")
    assert "1 data-parallel x 2 sequence-parallel" in log
    first = [{r["step"]: r for r in runs[sp] if "train/loss" in r}[1] for sp in (1, 2)]
    assert {k for k in LOGGED if k in first[0]} == {k for k in LOGGED if k in first[1]}
    assert first[0]["train/rows"] == 2 * first[1]["train/rows"]  # packed rows: each data-parallel rank's, the group's once
    for key in (k for k in LOGGED if k in first[0] and k != "train/rows"):
        assert abs(first[1][key] - first[0][key]) <= 1e-5 * max(1.0, abs(first[0][key])), (key, first[1][key], first[0][key])
    assert first[1]["rl/samples_seen"] == 16 and first[1].get("rl/kl", 0.0) == 0.0
    evals = [[r for r in runs[sp] if "eval/data/solve_rate" in r] for sp in (1, 2)]
    assert [r["step"] for r in evals[1]] == [2] and evals[1][0]["eval/data/reward_mean"] == evals[0][0]["eval/data/reward_mean"]


@pytest.mark.slow
def test_rollout_options_and_samples_files_through_the_command_line(tmp_path, prompts_and_model):
    """Stop strings, top-p, truncated samples masked, active sampling with up to 2 more draws, the samples file each
    step: what each option promises, read back from the samples files and the metrics."""
    data, init = prompts_and_model
    cfg = rl_config(tmp_path, data, init, max_steps=3)
    cfg["rl"].update(beta=0.0, stop=["."], top_p=0.95, truncated="mask", active_sampling_draws=2, samples_every=1)
    pretrain(tmp_path, cfg, "opts")
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run") if "train/loss" in r}
    assert sorted(rows) == [1, 2, 3]
    finishes = set()
    for step, r in rows.items():
        samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / f"step-{step:07d}.jsonl").read_text().splitlines()]
        draws = 1 + r.get("rollout/extra_draws", 0)
        assert len(samples) == 16 * draws == 4 * r["rollout/prompts"] and {x["draw"] for x in samples} == set(range(draws))
        kept_groups = {(x["draw"], x["prompt_index"]) for x in samples if x["dropped"] is None}
        assert len(kept_groups) <= 4
        assert r.get("rollout/surplus_groups", 0) == len({(x["draw"], x["prompt_index"]) for x in samples if x["dropped"] == "surplus"})
        if draws < 3:  # the draws stopped before the bound only because the step held a full batch of groups with signal
            assert len(kept_groups) == 4
        for x in samples:
            finishes.add(x["finish"])
            assert x["trained"] == (x["dropped"] is None and x["finish"] != "length")  # truncated: masked
            assert x["finish"] != "stop" or "." not in x["completion"]  # cut before its stop string
            assert set(x) >= {"prompt", "completion", "verifier", "score", "reward", "reason", "advantage", "finish", "length",
                              "logprob_mean", "dropped", "trained", "update", "sample", "prompt_index", "step"}
        assert sum(x["trained"] for x in samples) == r["rollout/trained_samples"]
    assert "length" in finishes


def test_advantages_are_centred_per_group_and_equal_groups_are_dropped():
    prompts = [Prompt([1, 2], "exact_match", "a", 0), Prompt([3], "exact_match", "b", 1), Prompt([4], "exact_match", "c", 2)]
    texts = ["a", "x", "a", "a", "y", "y", "y", "y", "c", "c", "c", "z"]
    samples = [Sample(prompt=k // 4, tokens=[5, 6], logprobs=[-1.0, -2.0], finish="eos", text=t) for k, t in enumerate(texts)]
    exact = lambda verifier, text, truth: float(text == truth)  # noqa: E731
    score_samples(samples, prompts, exact)
    groups = group_advantages(samples, prompts, samples_per_prompt=4, normalize_std=False)
    assert groups.dropped == 1 and groups.groups == 3 and len(groups.kept) == 8  # prompt 1: every reward 0
    assert [s.advantage for s in groups.kept] == [0.25, -0.75, 0.25, 0.25, 0.25, 0.25, 0.25, -0.75]
    std = group_advantages(samples, prompts, samples_per_prompt=4, normalize_std=True)
    a = torch.tensor([s.advantage for s in std.kept[:4]])
    assert abs(float(a.mean())) < 1e-12 and abs(float(a.std(unbiased=False)) - 1.0) < 1e-6
    assert groups.by_verifier["exact_match"] == [s.reward for s in samples]


def test_packed_rows_train_the_generated_tokens_only_with_their_log_probabilities():
    prompts = [Prompt([10, 11, 12], "v", None, 0), Prompt([20], "v", None, 1)]
    samples = [Sample(0, [13, 14], [-0.5, -0.25], "eos", "", advantage=1.5),
               Sample(1, [21, 22, 23], [-1.0, -2.0, -3.0], "length", "", advantage=-0.5)]
    rows = pack_rows(samples, prompts, 8, rows=2)
    assert rows["input_ids"][0].tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    # sample 2 (4 tokens) does not fit after sample 1 (5 tokens) in 8: first-fit opens row 2
    assert rows["doc_lens"].tolist() == [[5, 3], [4, 4]]
    assert rows["input_ids"][1, :4].tolist() == [20, 21, 22, 23]
    labels = rows["labels"]
    assert labels[0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 13, 14, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert labels[1].tolist() == [21, 22, 23, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert rows["sampled"][0, 2:4].tolist() == [-0.5, -0.25] and rows["sampled"][1, :3].tolist() == [-1.0, -2.0, -3.0]
    assert rows["advantages"][0, 2:4].tolist() == [1.5, 1.5] and rows["advantages"][1, :3].tolist() == [-0.5] * 3
    assert rows["positions"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert pack_rows(samples, prompts, 8, rows=4)["labels"][2:].eq(IGNORE_INDEX).all()  # padding rows train nothing
    with pytest.raises(ValueError, match="a sample of 5 tokens .* exceeds batch.seq_len 4"):
        pack_rows(samples, prompts, 4)


def test_several_updates_pack_each_updates_prompts_into_a_block_of_their_own():
    prompts = [Prompt([10 + p], "v", None, p) for p in range(4)]
    # prompt p's samples have p + 1 generated tokens: prompts 0 and 2 train in update 1, prompts 1 and 3 in update 2
    samples = [Sample(p, [50 + p] * (p + 1), [-0.5] * (p + 1), "eos", "", advantage=float(p + 1)) for p in range(4) for _ in range(2)]
    assert [update_of(s, 2) for s in samples] == [0, 0, 1, 1, 0, 0, 1, 1]
    # update 1: 2 + 2 + 4 + 4 tokens fit one row of 12; update 2: 3 + 3 + 5 + 5 need two
    assert rows_needed(samples, prompts, 12, updates=2) == 2 and rows_needed(samples, prompts, 12) == 3
    rows = pack_rows(samples, prompts, 12, rows=2, updates=2)
    assert rows["input_ids"].shape == (4, 12)
    trained = [set(rows["advantages"][r][rows["labels"][r] != IGNORE_INDEX].tolist()) for r in range(4)]
    assert trained == [{1.0, 3.0}, set(), {2.0, 4.0}, {4.0}]  # block 1: rows 0-1 (row 1 padding), block 2: rows 2-3
    assert rows["doc_lens"][1].tolist()[0] == 12 and rows["positions"][1].tolist() == list(range(12))
    assert pack_rows(samples, prompts, 12, rows=4, updates=2)["input_ids"].shape == (8, 12)  # each block at least `rows`


def test_sample_keys_depend_on_step_prompt_and_sample_only():
    keys = {sample_key(0, step, p, j) for step in range(3) for p in range(5) for j in range(8)}
    assert len(keys) == 120 and all(0 <= k < 2**32 for k in keys)
    assert sample_key(1, 2, 3, 4) == sample_key(1, 2, 3, 4) != sample_key(2, 2, 3, 4)


def test_a_sequence_groups_shares_of_the_samples_are_even_and_join_in_order():
    for pairs, size in ((16, 2), (12, 8), (3, 4), (0, 2)):
        shares = [group_share(pairs, size, r) for r in range(size)]
        assert [k for s in shares for k in s] == list(range(pairs))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
