"""GRPO step speed: one RL step's time split on a ZeRO-3 engine, against generation and SFT on the same work.

    python scripts/bench_rl.py                  # GPU: the 1B, 64 prompts x 8 samples, up to 1,024 new tokens, bf16
    python scripts/bench_rl.py --preset tiny    # CPU: a dry run in seconds

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

`--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch

from olmo_ds.model import OLMo, preset
from olmo_ds.model.decode import Request, Sampling, generate
from olmo_ds.model.model import make_blocks_zero3_leaves
from olmo_ds.tools.bench_generate import make_prompts
from olmo_ds.tools.harness import block_counts, current_device, environment, sync
from olmo_ds.train.config import RLConfig
from olmo_ds.train.ds_config import device_type, zero3_knobs
from olmo_ds.train.rl.grpo import RLObjective
from olmo_ds.train.objective import NextTokenLoss
from olmo_ds.train.parallel import ParallelLayout
from olmo_ds.train.rl.rollout import gathered_policy, sample_key


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
    p.add_argument("--micro-batch", type=int, default=2 if gpu else 2, help="rows per micro-batch")
    p.add_argument("--seq-len", type=int, default=None, help="row length (default: the longest prompt + new tokens)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=1, help="timed steps")
    p.add_argument("--warmup-prompts", type=int, default=None, help="prompts of each warm-up step (default: a quarter of "
                   "--prompts: enough to compile and capture every shape, at a quarter of a step's time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the numbers and the environment as JSON here")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len or min(args.prompts, args.new_tokens, args.generation_batch, args.steps) < 1 or args.samples < 2:
        p.error("need 1 <= --min-len <= --max-len, --prompts, --new-tokens, --generation-batch, --steps >= 1, --samples >= 2")
    warmup_prompts = max(1, args.warmup_prompts or args.prompts // 4)
    seq_len = args.seq_len or args.max_len + args.new_tokens
    cfg = preset(args.preset, max_seq_len=max(preset(args.preset).max_seq_len, seq_len))
    device, dtype = current_device(), torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(args.seed)
    engine = engine_for(cfg, args.micro_batch, dtype)
    rl = RLConfig(samples_per_prompt=args.samples, max_new_tokens=args.new_tokens, generation_batch_size=args.generation_batch,
                  seed=args.seed)
    objective = RLObjective(rl, seq_len=seq_len, micro_batch=args.micro_batch, world_size=1, vocab_size=cfg.vocab_size,
                            device=device, tokenizer=IdsAsText(), reward_fn=coin, stop_ids=[cfg.vocab_size - 1], decode_dtype=dtype)
    prompts = make_prompts(args.prompts * (args.warmup + args.steps), args.min_len, args.max_len, cfg.vocab_size, args.seed)
    print(f"bench_rl: {args.preset} ({dtype}, ZeRO-3) on {environment()['device']}; {args.prompts} prompts x {args.samples} "
          f"samples a step, prompts of {args.min_len}-{args.max_len} tokens, up to {args.new_tokens} new, generation batch "
          f"{args.generation_batch}, rows of {seq_len}, micro-batch {args.micro_batch}", flush=True)

    def batch_of(step: int) -> dict:
        n = args.prompts if step >= args.warmup else warmup_prompts
        part = prompts[step * args.prompts:step * args.prompts + n]
        return {"prompt_ids": part, "prompt_index": torch.arange(step * args.prompts, step * args.prompts + n),
                "verifier": ["coin"] * len(part), "ground_truth": [None] * len(part)}

    timings = []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        rows = objective.rollout(engine, batch_of(step), step=step)
        sync()
        timed_rows = rows
        rollout_s = time.perf_counter() - t0
        train_s = train_rows(engine, objective, rows, args.micro_batch)
        metrics = objective.end(torch.zeros(len(objective.stats), dtype=torch.float64), n_micro=1, world_size=1, tokens=0)
        if step >= args.warmup:
            generated = objective.last_rollout["length_sum"]
            timings.append({"rollout_s": rollout_s, "training_s": train_s, "gather_s": metrics["time/gather_s"],
                            "generation_s": metrics["time/generation_s"], "reward_s": metrics["time/reward_s"],
                            "generated_tokens": generated, "row_tokens": int(rows["input_ids"].numel()),
                            "trained_tokens": int((rows["labels"] != -100).sum()), "rows": int(rows["input_ids"].shape[0]),
                            "dropped_groups": metrics["rollout/dropped_groups"]})
            print(f"  step {step}: gather {timings[-1]['gather_s']:.2f} s, generation {timings[-1]['generation_s']:.2f} s "
                  f"({generated:,} tokens), reward {timings[-1]['reward_s']:.3f} s, training {train_s:.2f} s "
                  f"({timings[-1]['rows']} rows)", flush=True)
    last = timings[-1]

    # generation alone, on a plain model with the same weights: the decode engine as bench_generate.py times it
    step = args.warmup + args.steps - 1
    part = batch_of(step)
    requests = [Request(list(q), args.new_tokens, seed=sample_key(args.seed, step, int(i), j))
                for q, i in zip(part["prompt_ids"], part["prompt_index"].tolist()) for j in range(args.samples)]
    with gathered_policy(engine.module, dtype) as plain:
        sync()
        t0 = time.perf_counter()
        done = generate(plain, requests, batch_size=args.generation_batch, sampling=Sampling(temperature=1.0, seed=args.seed),
                        stop_ids=[cfg.vocab_size - 1], tokenizer=IdsAsText())
        sync()
        gen_s = time.perf_counter() - t0
    gen_tokens = sum(len(c.tokens) for c in done.completions)

    # SFT on the last timed step's rows: the fine-tuning objective (token mean over the same generated tokens), same engine
    sft = NextTokenLoss(masked=True, sp=None, layout=ParallelLayout(rank=0, world_size=1, sp_size=1), z_loss_coef=0.0, device=device)
    rows = timed_rows
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
        "blocks": block_counts(),  # dynamo_graphs at ~8 or more per kind of block call: recompiles, eager blocks
    }
    out["rollout_vs_generate"] = out["rollout_tokens_per_s"] / out["generate_tokens_per_s"]
    out["training_vs_sft"] = out["training_row_tokens_per_s"] / out["sft_row_tokens_per_s"]
    total = last["gather_s"] + last["generation_s"] + last["reward_s"] + last["training_s"]
    blocks = out["blocks"]
    print(f"block calls: {blocks['blocks_compiled']:,} compiled, {blocks['blocks_eager']:,} eager; "
          f"{blocks['dynamo_graphs']} graphs compiled in all")
    print("\n| part | seconds | share | tokens/s | against |")
    print("|---|---|---|---|---|")
    print(f"| weight gathering | {last['gather_s']:.2f} | {last['gather_s'] / total:.1%} | | target <= 1 s for the 1B |")
    print(f"| generation | {last['generation_s']:.2f} | {last['generation_s'] / total:.1%} | {out['rollout_tokens_per_s']:,.0f} | "
          f"generate() alone: {out['generate_tokens_per_s']:,.0f} ({out['rollout_vs_generate']:.2f}x) |")
    print(f"| reward | {last['reward_s']:.3f} | {last['reward_s'] / total:.1%} | | |")
    print(f"| training | {last['training_s']:.2f} | {last['training_s'] / total:.1%} | {out['training_row_tokens_per_s']:,.0f} | "
          f"SFT on the same rows: {out['sft_row_tokens_per_s']:,.0f} ({out['training_vs_sft']:.2f}x) |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "environment": environment(), **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
