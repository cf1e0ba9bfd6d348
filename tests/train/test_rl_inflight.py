"""In-flight RL rollouts (`rl.async_steps`, issue 61): the decode engine runs ahead of training by up to A steps,
each sample records the policy versions it was drawn under, a stop request leaves a state that resumes exactly,
and a run through scripts/pretrain.py resumes from a checkpoint bit for bit on CPU with its samples in flight
restored, not drawn again.

The objective-level tests use a plain tiny OLMo as the "engine" (`rollout.gather_into` copies a module without
ZeRO-3 partitions as it is) and a checksum reward, so they run in seconds; the command-line test is the slow tier's."""

from __future__ import annotations

import io
import json
import shutil
import zlib

import pytest
import torch

from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader
from olmo_ds.model import OLMo
from olmo_ds.model.config import preset
from olmo_ds.train.config import ConfigError, RLConfig
from olmo_ds.train.rl.grpo import RLObjective
from olmo_ds.weights import load_weights

from test_rl_config import config, prompt_shards  # noqa: F401 (a fixture: the plan tests' prompts)
from train_testlib import DOLMA2, ROOT, read_metrics, rl_inputs, run, tiny_config, torchrun_cmd, write_config

PROMPTS, G = 3, 4  # a step's prompts and samples per prompt: 12 samples through 5 slots


class IdsAsText:
    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def coin(verifier, text, truth) -> float:
    return float(zlib.crc32(text.encode()) & 1)


def lengths(step: int, prompt: int, sample: int) -> int:
    """Each sample's own length (a random model never ends one): 1 to 12 tokens."""
    return 1 + zlib.crc32(f"{step}:{prompt}:{sample}".encode()) % 12


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(1, 120, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(PROMPTS)]
    return {"prompt_ids": ids, "prompt_index": torch.arange(step * PROMPTS, (step + 1) * PROMPTS), "verifier": ["c"] * PROMPTS,
            "ground_truth": [None] * PROMPTS}


def model() -> OLMo:
    torch.manual_seed(0)
    return OLMo(preset("tiny", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, max_seq_len=64, vocab_size=128))


def objective(async_steps: int, slots: int = 5) -> RLObjective:
    rl = RLConfig(samples_per_prompt=G, max_new_tokens=12, generation_batch_size=slots, async_steps=async_steps)
    return RLObjective(rl, seq_len=24, micro_batch=2, world_size=1, vocab_size=128, device=torch.device("cpu"), tokenizer=IdsAsText(),
                       reward_fn=coin, stop_ids=[127], decode_dtype=torch.float32, prompts_at=batch, sample_lengths=lengths)


def update(policy: OLMo, step: int) -> None:
    """A stand-in for an optimizer step: every weight moves, differently each step."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * (step + 1))


def steps(obj: RLObjective, policy: OLMo, first: int, last: int, out: dict, stop_at: tuple[int, int] | None = None) -> dict:
    """Steps `first`..`last` - 1: each step's samples (tokens, log-probabilities, versions, dropped) into `out`. With
    `stop_at` (step, n) a stop request arrives at that step's n-th check and the rollout is abandoned (returns there)."""
    for step in range(first, last):
        checks = iter(range(10**6))
        stop = (lambda: next(checks) >= stop_at[1]) if stop_at and stop_at[0] == step else None
        rows = obj.rollout(policy, batch(step), step=step, should_stop=stop)
        if rows is None:
            return out
        out[step] = [(s.prompt, s.index, s.tokens, s.logprobs, s.versions, s.dropped) for s in obj.last_samples[0]]
        out[step, "metrics"] = obj.rollout_metrics([obj.last_rollout])
        update(policy, step)
    return out


def saved(obj: RLObjective) -> dict:
    """The rank file a checkpoint holds, through torch.save and a weights_only load, as a resume reads it."""
    (state,) = obj.rank_files().values()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_samples_run_ahead_by_at_most_async_steps_and_record_their_versions():
    sync = steps(objective(0), model(), 0, 4, {})
    ahead = steps(objective(1), model(), 0, 4, {})
    assert ahead[0] == [(p, i, t, lp, (0, 0), d) for p, i, t, lp, _, d in sync[0]]  # step 0: one policy, the same draws
    started = [v[0] for step in range(4) for *_, v, _ in ahead[step]]
    for step in range(4):
        m = ahead[step, "metrics"]
        staleness = [step - v[0] for *_, v, _ in ahead[step]]
        assert all(0 <= s <= 1 for s in staleness) and m["rollout/staleness_max"] == max(staleness) and m["rollout/stale_dropped"] == 0
        assert m["rollout/staleness_mean"] == sum(staleness) / len(staleness)
        assert all(v[0] <= v[1] <= step for *_, v, _ in ahead[step])
        assert m["time/learner_wait_s"] == m["time/generation_s"] > 0 and m["time/actor_wait_s"] == 0.0
    assert any(step - v for step, v in zip([s for s in range(4) for _ in range(PROMPTS * G)], started))  # some ran ahead
    assert any(v[0] != v[1] for step in range(1, 4) for *_, v, _ in ahead[step])  # weights swapped under a sample in flight
    # the queue never drains: every decode step after the first rollout's start fills the slots, which A = 0's tail does not
    occupancy = {run: [steps[s, "metrics"]["rollout/occupancy"] for s in range(3)] for run, steps in (("sync", sync), ("ahead", ahead))}
    assert min(occupancy["ahead"]) > max(occupancy["sync"])
    # a run resumed with a lower async_steps drops the groups started too long ago, and counts them (20 slots: step s + 2
    # starts while step s decodes)
    two = objective(2, slots=20)
    policy = model()
    steps(two, policy, 0, 2, {})
    one = objective(1, slots=20)
    one.inflight.load_state_dict(saved(two))
    after = steps(one, policy, 2, 4, {})
    stale = [d == "stale" for step in (2, 3) for *_, d in after[step]]
    assert sum(after[s, "metrics"]["rollout/stale_dropped"] for s in (2, 3)) == sum(stale) > 0


def test_a_stop_mid_rollout_and_a_resume_from_the_saved_state_draw_what_an_uninterrupted_run_does():
    straight = steps(objective(1), model(), 0, 5, {})
    first, policy = objective(1), model()
    got = steps(first, policy, 0, 5, {}, stop_at=(2, 7))  # stopped at step 2, 7 forwards into its decoding
    assert sorted(k for k in got if isinstance(k, int)) == [0, 1]
    state = saved(first)
    assert state["submitted"] == 3 and state["done"] and state["decoder"]["active"]
    for a in state["decoder"]["active"]:  # the cache entries each sequence wrote, not its whole slot
        assert {t.shape[1] for t in a["keys"] + a["values"]} == {len(a["request"][0]) + len(a["tokens"]) - 1}
    resumed = objective(1)  # a new process: its own decode copy and decoder, the state restored into them
    resumed.inflight.load_state_dict(state)
    got = steps(resumed, policy, 2, 5, got)
    for step in range(5):
        assert got[step] == straight[step], step
    # another rank's stop: this rank had all of step 2's samples when the step was abandoned; they stay queued
    other, policy = objective(1), model()
    steps(other, policy, 0, 2, {})
    with other.inflight.policy_at(policy, torch.float32, 2, {}):
        assert len(other.inflight.collect(2, other._prompts(batch(2)), None, {})) == PROMPTS * G
    resumed = objective(1)
    resumed.inflight.load_state_dict(saved(other))
    got = steps(resumed, policy, 2, 5, {})
    assert [got[step] for step in (2, 3, 4)] == [straight[step] for step in (2, 3, 4)]
    with pytest.raises(ConfigError, match="the checkpoint's samples in flight do not fit this run's decoder"):
        other = RLObjective(RLConfig(samples_per_prompt=G, max_new_tokens=12, generation_batch_size=6, async_steps=1), seq_len=24,
                            micro_batch=2, world_size=1, vocab_size=128, device=torch.device("cpu"), tokenizer=IdsAsText(),
                            reward_fn=coin, stop_ids=[127], prompts_at=batch, sample_lengths=lengths)
        other.inflight.load_state_dict(state)
        other.rollout(model(), batch(2), step=2)


@pytest.mark.parametrize("rl,message", [
    ({"async_steps": -1}, r"rl.async_steps must be an integer >= 0 \(0: off\), got -1"),
    ({"async_steps": 1, "active_sampling_draws": 2}, r"rl.async_steps 1 with rl.active_sampling_draws 2: an extra draw"),
])
def test_bad_async_steps_are_refused_naming_the_key(tmp_path, rl, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, {"max_new_tokens": 16, **rl})


def test_async_steps_with_sequence_parallelism_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"rl.async_steps 1 with parallel.sequence_parallel_size 2: the ranks of a sequence group"):
        config(tmp_path, {"max_new_tokens": 16, "async_steps": 1}, parallel={"sequence_parallel_size": 2})


def test_the_loaders_prompts_of_any_step_are_what_next_batch_gives_there(prompt_shards):
    """Every rank's, ahead of its loader, behind it, and across the epoch's end (36 prompts, 8 a step) under a batch-size
    schedule."""
    data = DataConfig(sources=[SourceConfig(str(prompt_shards))], seed=3, prefetch=1)
    for rank in (0, 1):
        loader = DataLoader(data, seq_len=128, global_batch_size=[(0, 4), (2, 8)], dp_rank=rank, dp_world_size=2)
        ahead = [loader.prompts_at(step) for step in range(7)]
        got = [loader.next_batch() for _ in range(6)]
        assert [b["prompt_index"].tolist() for b in got] == [b["prompt_index"].tolist() for b in ahead[:6]]
        assert [b["prompt_ids"] for b in got] == [b["prompt_ids"] for b in ahead[:6]]
        assert loader.prompts_at(6)["prompt_index"].tolist() == ahead[6]["prompt_index"].tolist()  # pure in the step
        assert loader.prompts_at(1)["prompt_index"].tolist() == got[1]["prompt_index"].tolist()
        assert [len(b["prompt_ids"]) for b in got] == [2, 2, 4, 4, 4, 4]
        loader.close()


# --- through the command line ---------------------------------------------------------------------------------------

SEQ = 160
MODEL = {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64, "max_seq_len": SEQ}


@pytest.fixture(scope="module")
def prompts_and_model(tmp_path_factory):
    return rl_inputs(tmp_path_factory.mktemp("rl-inflight"), count=60, max_tokens=128, model=MODEL)


def pretrain(tmp_path, cfg, name, *extra):
    result = run(torchrun_cmd(ROOT / "scripts" / "pretrain.py", "--config", str(write_config(tmp_path / f"{name}.yaml", cfg)), *extra,
                              nproc=1))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def samples_of(run_dir, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / f"step-{step:07d}.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two short runs through the command line, ~60 s on 2 cores
def test_an_in_flight_run_trains_and_resumes_from_a_checkpoint_bit_for_bit(tmp_path, prompts_and_model):
    data, init = prompts_and_model
    cfg = tiny_config(tmp_path, data, **{
        "max_steps": 4, "model": MODEL, "init_from": {"path": str(init)}, "tokenizer": str(DOLMA2),
        "batch": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": SEQ},
        "optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0}, "schedule": {"kind": "constant", "warmup_steps": 0},
        "rl": {"samples_per_prompt": 4, "max_new_tokens": 16, "generation_batch_size": 6, "seed": 5, "samples_every": 1, "async_steps": 1},
        "checkpoint": {"every": 2, "keep_last": 2}, "logging": {"every": 1, "tensorboard": False}})
    pretrain(tmp_path, cfg, "straight")
    straight = tmp_path / "run"
    steps = {r["step"]: r for r in read_metrics(straight) if "train/loss" in r}
    assert sorted(steps) == [1, 2, 3, 4] and (straight / "checkpoints" / "step-0000002" / "rl_inflight" / "rank-00000.pt").is_file()
    for step, r in steps.items():
        samples = samples_of(straight, step)
        staleness = [step - 1 - x["versions"][0] for x in samples]
        assert len(samples) == 16 and all(0 <= s <= 1 for s in staleness) and r["rollout/staleness_max"] == max(staleness)
        assert all(step - 1 - x["versions"][1] >= 0 for x in samples) and r["rollout/stale_dropped"] == 0
        assert 0 < r["rollout/occupancy"] <= 1 and r["time/learner_wait_s"] > 0 and r["time/actor_wait_s"] == 0.0
    assert any(r["rollout/staleness_max"] == 1 for r in steps.values()) and any(r["rl/generated_tokens"] for r in steps.values())

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    log = pretrain(tmp_path, {**cfg, "run_dir": str(resumed)}, "resumed", "--resume", "auto")
    assert "rl.async_steps 1" in log
    got = {r["step"]: r for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert samples_of(resumed, step) == samples_of(straight, step), step
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rl/generated_tokens", "rollout/staleness_mean",
                    "rollout/occupancy", "rl/importance_ratio_max"):
            assert got[step].get(key) == steps[step].get(key), (step, key)
    final = [load_weights(run_dir / "checkpoints" / "step-0000004").state_dict for run_dir in (straight, resumed)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])

    # another world size is refused, naming the key, before any step
    result = run(torchrun_cmd(ROOT / "scripts" / "pretrain.py", "--config",
                              str(write_config(tmp_path / "two.yaml", {**cfg, "run_dir": str(resumed), "max_steps": 6})),
                              "--resume", "auto", nproc=2))
    assert result.returncode != 0 and "rl.async_steps 1, this run has 2" in result.stdout + result.stderr
