"""GRPO step speed: one RL step's time split on a ZeRO-3 engine, against generation and SFT on the same work.

    python scripts/bench_rl.py                  # GPU: the 1B, 64 prompts x 8 samples, up to 1,024 new tokens, bf16
    python scripts/bench_rl.py --preset tiny    # CPU: a dry run in seconds
    python scripts/bench_rl.py --lengths realistic --async-steps 0,1 --steps 4   # synchronous against in-flight rollouts

One process, one device, the model of `--preset` with random weights (speed does not depend on them) under
DeepSpeed ZeRO-3 (`ds_configs/zero3_bf16.json`'s settings; fp32 on CPU). Prompts are random ids of uniformly drawn
lengths; a random model rarely samples its EOS, so nearly every sample runs to `--new-tokens`. Rewards are a
deterministic coin per sample (a verifier's cost is not what this measures; `time/reward_s` is reported anyway),
so groups keep a reward spread and train. After `--warmup` steps, `--steps` RL steps are timed through
`olmo_ds.train.rl.grpo.RLObjective` exactly as the trainer calls it (`rollout`, then `begin` / `forward` /
`engine.backward` / `engine.step` per micro-batch), and reported as the step's split: weight gathering,
generation, reward, training. Then, in the same process:

- generation alone: `olmo_ds.model.decode.generate` (what scripts/bench_generate.py's olmo-ds row times) on a plain
  model holding the same weights, the same requests and batch size: the rollout's generated tokens/s against it;
- SFT on the same rows: the trainer's fine-tuning objective (`NextTokenLoss`, masked rows: the token-mean loss
  over the same generated tokens) through the same engine: the RL training part's row tokens/s against it.

`--async-steps 0,1` runs the timed steps once per value of `rl.async_steps`, one after the other on the same engine
(in-flight rollouts, `olmo_ds.train.rl.inflight`), and reports them side by side: the decode occupancy (the mean share
of the decoder's slots in use while the step decoded), the decode steps' tokens/s, the step's time (rollout and
training) and its samples' generated tokens per second of step time, the throughput the run sees. The split and the
comparisons below are the first value's.

`--lengths realistic`: a random model never samples its EOS, so with `max` (the default) every sample runs to
`--new-tokens` and a synchronous step's decode batch never thins out, which hides what in-flight rollouts are for.
`realistic` gives each sample its own limit, drawn log-normal from its (seed, step, prompt, sample) key with a mean
of 40% of `--new-tokens` and 15% of samples reaching it (`realistic_length`), near OLMo 3's RL spread (a mean of
14.6K of 32K new tokens with a long tail at the limit; docs/training.md says why it matters). The limit is the
request's own max_new_tokens (`RLObjective`'s `sample_lengths`, a benchmark hook, not a config key).

`--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

import torch

from olmo_ds.model import OLMo, preset
from olmo_ds.model.decode import Sampling, generate
from olmo_ds.model.model import make_blocks_zero3_leaves
from olmo_ds.tools.bench_generate import copy_bandwidth, decode_bound_s, make_prompts
from olmo_ds.tools.harness import block_counts, current_device, environment, sync
from olmo_ds.train.config import RLConfig
from olmo_ds.train.ds_config import device_type, zero3_knobs
from olmo_ds.train.rl.grpo import RLObjective
from olmo_ds.train.objective import NextTokenLoss
from olmo_ds.train.parallel import ParallelLayout
from olmo_ds.data.dataset import Prompt
from olmo_ds.train.rl.rollout import gathered_policy, sample_key, sample_requests

# log(length / max) ~ Normal(MU, SIGMA): P(length >= max) = 0.15 (MU = -SIGMA * Phi^-1(0.85)) and E[min(length, max)] =
# 0.4 max (SIGMA solved for it: E[min(X, 1)] = exp(MU + SIGMA^2 / 2) Phi((-MU - SIGMA^2) / SIGMA) + 0.15)
SIGMA = 1.2412
MU = -1.0364 * SIGMA


def realistic_length(seed: int, max_new_tokens: int):
    """`RLObjective`'s `sample_lengths` for `--lengths realistic`: (step, prompt, sample) -> that sample's limit, from
    1 to `max_new_tokens`, log-normal with a mean of 40% of it and 15% at it (module docstring)."""
    def length(step: int, prompt: int, sample: int) -> int:
        z = torch.randn((), generator=torch.Generator().manual_seed(sample_key(seed, step, prompt, sample)), dtype=torch.float64)
        return max(1, min(max_new_tokens, math.ceil(max_new_tokens * math.exp(MU + SIGMA * float(z)))))
    return length


class IdsAsText:
    """The bench's "tokenizer": a sample's text is its ids, so the coin below sees what was sampled (the random
    model has no tokenizer; decoding real text is not what this measures)."""

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def coin(verifier: str, text: str, ground_truth) -> float:
    """A reward that splits every group about evenly (a checksum of the sample's ids): no verifier cost, and groups
    keep a reward spread, so nearly every sample trains."""
    return float(zlib.crc32(text.encode()) & 1)


def engine_for(cfg, micro: int, dtype: torch.dtype, lr: float = 1e-6):
    import deepspeed

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", auto_mpi_discovery=False)
    compiled = cfg.compiles_blocks(device_type())
    # the ZeRO-3 knobs and leaf blocks the trainer gives this model (`ds_config.zero3_knobs`, `Trainer._build_engine`)
    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 3, **zero3_knobs(cfg.d_model, 3, compiled, dp_world_size=1)},
          "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}, "bf16": {"enabled": dtype == torch.bfloat16}}
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = OLMo(cfg)
    if compiled:
        make_blocks_zero3_leaves(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def train_rows(engine, objective, rows: dict, micro: int) -> float:
    """One optimizer step over `rows` as the trainer runs it; seconds."""
    sync()
    t0 = time.perf_counter()
    n_micro = rows["input_ids"].shape[0] // micro
    engine.set_train_batch_size(rows["input_ids"].shape[0])
    batch = objective.begin(rows, n_micro)
    sums = torch.zeros(len(objective.stats), dtype=torch.float64, device=engine.device)
    for i in range(n_micro):
        mb = {k: v[i * micro:(i + 1) * micro] for k, v in batch.items()}
        engine.set_gradient_accumulation_boundary(i == n_micro - 1)
        loss, stats = objective.forward(engine, mb)
        sums += stats
        engine.backward(loss)
        engine.step()
    torch.distributed.all_reduce(sums)
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python scripts/bench_rl.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny", help="model preset, random weights (default: olmo2-1b on GPU, tiny on CPU)")
    p.add_argument("--prompts", type=int, default=64 if gpu else 4, help="prompts a step")
    p.add_argument("--samples", type=int, default=8 if gpu else 4, help="samples per prompt (rl.samples_per_prompt)")
    p.add_argument("--min-len", type=int, default=64 if gpu else 8, help="shortest prompt")
    p.add_argument("--max-len", type=int, default=256 if gpu else 24, help="longest prompt")
    p.add_argument("--new-tokens", type=int, default=1024 if gpu else 8, help="rl.max_new_tokens")
    p.add_argument("--generation-batch", type=int, default=128 if gpu else 8, help="rl.generation_batch_size")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default: on a GPU as many rows as make "
                   "pretraining's 16,384-token micro-batch (bench_train's 4 x 4,096), 2 on CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="row length (default: the longest prompt + new tokens)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=1, help="timed steps")
    p.add_argument("--warmup-prompts", type=int, default=None, help="prompts of each warm-up step (default: a quarter of "
                   "--prompts: enough to compile and capture every shape, at a quarter of a step's time)")
    p.add_argument("--async-steps", default="0", help="rl.async_steps values to time one after the other, e.g. 0,1")
    p.add_argument("--lengths", choices=("max", "realistic"), default="max", help="samples' lengths: all --new-tokens (a random "
                   "model's), or each its own, log-normal with a mean of 40%% of it and 15%% at it (OLMo 3's spread)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the numbers and the environment as JSON here")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len or min(args.prompts, args.new_tokens, args.generation_batch, args.steps) < 1 or args.samples < 2:
        p.error("need 1 <= --min-len <= --max-len, --prompts, --new-tokens, --generation-batch, --steps >= 1, --samples >= 2")
    try:
        ahead = [int(a) for a in args.async_steps.split(",")]
    except ValueError:
        ahead = [-1]
    if not ahead or min(ahead) < 0:
        p.error(f"--async-steps: comma-separated integers >= 0, got {args.async_steps!r}")
    warmup_prompts = max(1, args.warmup_prompts or args.prompts // 4)
    seq_len = args.seq_len or args.max_len + args.new_tokens
    # ZeRO-3 pays a fixed cost per micro-batch (its hooks, gathers and gradient partitioning: ~0.1 s for the 1B on one
    # H100), so rows of 1,280 two at a time train at ~0.4x pretraining's tokens/s; micro-batches of pretraining's
    # tokens pay it as pretraining does. The loss does not depend on it (the token mean's divisor is the step's).
    args.micro_batch = args.micro_batch or (max(1, 16384 // seq_len) if gpu else 2)
    cfg = preset(args.preset, max_seq_len=max(preset(args.preset).max_seq_len, seq_len))
    device, dtype = current_device(), torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(args.seed)
    engine = engine_for(cfg, args.micro_batch, dtype)
    lengths = realistic_length(args.seed, args.new_tokens) if args.lengths == "realistic" else None
    n_steps = args.warmup + args.steps
    prompts = make_prompts(args.prompts * (n_steps + max(ahead)), args.min_len, args.max_len, cfg.vocab_size, args.seed)
    print(f"bench_rl: {args.preset} ({dtype}, ZeRO-3) on {environment()['device']}; {args.prompts} prompts x {args.samples} "
          f"samples a step, prompts of {args.min_len}-{args.max_len} tokens, up to {args.new_tokens} new ({args.lengths} lengths), "
          f"generation batch {args.generation_batch}, rows of {seq_len}, micro-batch {args.micro_batch}, rl.async_steps "
          f"{args.async_steps}", flush=True)

    def batch_of(step: int) -> dict:
        n = args.prompts if step >= args.warmup else warmup_prompts
        part = prompts[step * args.prompts:step * args.prompts + n]
        return {"prompt_ids": part, "prompt_index": torch.arange(step * args.prompts, step * args.prompts + n),
                "verifier": ["coin"] * len(part), "ground_truth": [None] * len(part)}

    runs = {}
    for a in ahead:
        rl = RLConfig(samples_per_prompt=args.samples, max_new_tokens=args.new_tokens, generation_batch_size=args.generation_batch,
                      seed=args.seed, async_steps=a)
        objective = RLObjective(rl, seq_len=seq_len, micro_batch=args.micro_batch, world_size=1, vocab_size=cfg.vocab_size,
                                device=device, tokenizer=IdsAsText(), reward_fn=coin, stop_ids=[cfg.vocab_size - 1], decode_dtype=dtype,
                                prompts_at=batch_of, sample_lengths=lengths)
        timings = []
        for step in range(n_steps):
            sync()
            t0 = time.perf_counter()
            rows = objective.rollout(engine, batch_of(step), step=step)
            sync()
            rollout_s = time.perf_counter() - t0
            train_s = train_rows(engine, objective, rows, args.micro_batch)
            metrics = objective.end(torch.zeros(len(objective.stats), dtype=torch.float64), n_micro=1, world_size=1, tokens=0)
            if step >= args.warmup:
                generated = objective.last_rollout["length_sum"]
                timings.append({"rollout_s": rollout_s, "training_s": train_s, "gather_s": metrics["time/gather_s"],
                                "generation_s": metrics["time/generation_s"], "reward_s": metrics["time/reward_s"],
                                "generated_tokens": generated, "row_tokens": int(rows["input_ids"].numel()),
                                "trained_tokens": int((rows["labels"] != -100).sum()), "rows": int(rows["input_ids"].shape[0]),
                                "dropped_groups": metrics["rollout/dropped_groups"], "occupancy": metrics.get("rollout/occupancy", 1.0),
                                "decode_rows": objective.last_rollout["decode"].get("decode_rows", 0),
                                "staleness_mean": metrics.get("rollout/staleness_mean", 0.0)})
                print(f"  rl.async_steps {a}, step {step}: gather {timings[-1]['gather_s']:.2f} s, generation "
                      f"{timings[-1]['generation_s']:.2f} s ({generated:,} tokens, occupancy {timings[-1]['occupancy']:.2f}), reward "
                      f"{timings[-1]['reward_s']:.3f} s, training {train_s:.2f} s ({timings[-1]['rows']} rows)", flush=True)
        if objective.inflight is not None:
            objective.inflight.close()  # its decode copy and cache, before the next value's
        total = lambda k: sum(t[k] for t in timings)  # noqa: E731
        step_s = total("rollout_s") + total("training_s")
        runs[a] = {"steps": timings, "occupancy": sum(t["occupancy"] * t["decode_rows"] for t in timings) / max(total("decode_rows"), 1),
                   "decode_tokens_per_s": total("decode_rows") / total("generation_s"), "step_s": step_s / len(timings),
                   "step_tokens_per_s": total("generated_tokens") / step_s, "staleness_mean": total("staleness_mean") / len(timings),
                   "timed_rows": rows}
    first = runs[ahead[0]]
    last = first["steps"][-1]

    # generation alone, on a plain model with the same weights: the decode engine as bench_generate.py times it
    step = n_steps - 1
    part = batch_of(step)
    pairs = [(Prompt(list(q), "coin", None, int(i)), j) for q, i in zip(part["prompt_ids"], part["prompt_index"].tolist())
             for j in range(args.samples)]
    requests = sample_requests(pairs, step=step, seed=args.seed, max_new_tokens=args.new_tokens, lengths=lengths)
    bandwidth = copy_bandwidth(device) if gpu else None  # before the decode copy and its cache take their memory
    with gathered_policy(engine.module, dtype) as plain:
        sync()
        t0 = time.perf_counter()
        done = generate(plain, requests, batch_size=args.generation_batch, sampling=Sampling(temperature=1.0, seed=args.seed),
                        stop_ids=[cfg.vocab_size - 1], tokenizer=IdsAsText())
        sync()
        gen_s = time.perf_counter() - t0
        # The same requests' decode steps at their bytes bound (bench_generate's): what the rollout's generation could take at best
        bound_s = decode_bound_s(plain, done.stats, bandwidth) if gpu else None
    gen_tokens = sum(len(c.tokens) for c in done.completions)

    # SFT on the first value's last timed step's rows: the fine-tuning objective (token mean over the same generated
    # tokens), same engine
    sft = NextTokenLoss(masked=True, sp=None, layout=ParallelLayout(rank=0, world_size=1, sp_size=1), z_loss_coef=0.0, device=device)
    rows = first.pop("timed_rows")
    for run in runs.values():
        run.pop("timed_rows", None)
    sft_rows = {k: rows[k] for k in ("input_ids", "labels", "positions", "doc_lens")}
    sft_rows["row_tokens"] = rows["doc_lens"].long().sum(1)
    train_rows(engine, sft, sft_rows, args.micro_batch)  # warm
    sft_s = train_rows(engine, sft, sft_rows, args.micro_batch)

    out = {
        "step": last,
        "rollout_tokens_per_s": last["generated_tokens"] / last["generation_s"],
        "generate_tokens_per_s": gen_tokens / gen_s,
        "training_row_tokens_per_s": last["row_tokens"] / last["training_s"],
        "sft_row_tokens_per_s": int(sft_rows["input_ids"].numel()) / sft_s,
        "async_steps": {str(a): run for a, run in runs.items()},
        "blocks": block_counts(),  # dynamo_graphs at ~8 or more per kind of block call: recompiles, eager blocks
    }
    out["rollout_vs_generate"] = out["rollout_tokens_per_s"] / out["generate_tokens_per_s"]
    out["decode_bound_s"] = bound_s
    out["rollout_vs_bound"] = bound_s / last["generation_s"] if bound_s else None
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if gpu else None
    out["training_vs_sft"] = out["training_row_tokens_per_s"] / out["sft_row_tokens_per_s"]
    total = last["gather_s"] + last["generation_s"] + last["reward_s"] + last["training_s"]
    blocks = out["blocks"]
    print(f"block calls: {blocks['blocks_compiled']:,} compiled, {blocks['blocks_eager']:,} eager; "
          f"{blocks['dynamo_graphs']} graphs compiled in all")
    print(f"\n| rl.async_steps | decode occupancy | decode tokens/s | step s | step tokens/s | vs {ahead[0]} | staleness mean |")
    print("|---|---|---|---|---|---|---|")
    for a, run in runs.items():
        print(f"| {a} | {run['occupancy']:.3f} | {run['decode_tokens_per_s']:,.0f} | {run['step_s']:.2f} | {run['step_tokens_per_s']:,.0f} | "
              f"{run['step_tokens_per_s'] / first['step_tokens_per_s']:.2f}x | {run['staleness_mean']:.2f} |")
    print("\n| part | seconds | share | tokens/s | against |")
    print("|---|---|---|---|---|")
    print(f"| weight gathering | {last['gather_s']:.2f} | {last['gather_s'] / total:.1%} | | target <= 1 s for the 1B |")
    print(f"| generation | {last['generation_s']:.2f} | {last['generation_s'] / total:.1%} | {out['rollout_tokens_per_s']:,.0f} | "
          f"generate() alone: {out['generate_tokens_per_s']:,.0f} ({out['rollout_vs_generate']:.2f}x)"
          + (f"; decode steps' bytes bound {bound_s:.2f} s: {out['rollout_vs_bound']:.2f} of it" if bound_s else "") + " |")
    print(f"| reward | {last['reward_s']:.3f} | {last['reward_s'] / total:.1%} | | |")
    print(f"| training | {last['training_s']:.2f} | {last['training_s'] / total:.1%} | {out['training_row_tokens_per_s']:,.0f} | "
          f"SFT on the same rows: {out['sft_row_tokens_per_s']:,.0f} ({out['training_vs_sft']:.2f}x) |")
    if gpu:
        print(f"\npeak GPU memory {out['peak_gib']:.1f} GiB")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "environment": environment(), **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
