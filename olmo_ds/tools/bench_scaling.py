"""ZeRO-3 weak scaling on one host: the same per-GPU work on 1, 2, 4, 8 GPUs, one launch each, and a table of
tokens/s per GPU, MFU and peak memory against one GPU, with the memory plan's estimate beside the measured peak.

    python scripts/bench_scaling.py --gpus 1,2,4,8                          # GPUs: olmo2-1b, seq 4096, micro-batch 4
    python scripts/bench_scaling.py --preset olmo3-7b --gpus 8 --micro-batch-size auto --model-set activation_checkpointing=full
    python scripts/bench_scaling.py --preset tiny --seq-len 128 --gpus 1,2 --steps 2     # CPU ranks (gloo)

Every size trains the same model with `--micro-batch-size` x `--grad-accum` rows per GPU per step (weak scaling:
the global batch grows with the GPUs), on generated document-masked rows, through the real `Trainer` under
torchrun (`harness.launch_timed`), so what is timed is what `scripts/pretrain.py` runs, ZeRO-3 partitioning and
its collectives included. Tokens/s per GPU is the step's tokens over its wall time over the GPUs; the peak is the
largest `torch.cuda.max_memory_allocated` of any rank over the timed steps; "estimate" is the peak that
`olmo_ds.train.memory` predicted for the micro-batch the run trained with (what `batch.micro_batch_size: auto`
and `scripts/memory_plan.py` decide by). Issue 47's target: the largest size at >= 0.90 of one GPU's tokens/s
per GPU. Each size's config, JSON and log go to the work directory; the table is printed last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

from olmo_ds.tools.harness import add_launch_options, generate_shards, launch_timed, timed_launch_worker

TARGET = 0.90


def config_tree(args, data: Path, gpus: int, work: Path) -> dict:
    gpu = torch.cuda.is_available()
    model = {"preset": args.preset}
    for assignment in args.model_set:
        key, value = assignment.split("=", 1)
        model[key] = yaml.safe_load(value)
    micro = args.micro_batch_size if args.micro_batch_size == "auto" else int(args.micro_batch_size)
    rows = (4 if micro == "auto" else micro) * args.grad_accum  # with auto, rows per GPU that the chosen micro-batch divides
    return {
        "run_dir": str(work / f"run-{gpus}"), "max_steps": args.warmup + args.steps,
        "precision": "bf16" if gpu else "fp32", "model": model, "deepspeed_config": args.ds_config,
        "data": {"sources": [{"path": str(data)}], "document_masking": True, "prefetch": 2},
        "batch": {"global_batch_size": rows * gpus, "micro_batch_size": micro, "seq_len": args.seq_len},
        "schedule": {"kind": "constant"}, "checkpoint": {"every": 0, "save_final": False},
        "logging": {"every": 1, "tensorboard": False},
    }


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["gpus"] == 1), None)
    lines = ["| GPUs | micro-batch | tokens/s per GPU | vs 1 GPU | MFU | peak GiB (largest rank) | estimate GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}" if base else "-"
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] else "-"
        estimate = r["micro_batch"]["estimate_bytes"]
        lines.append(f"| {r['gpus']} | {r['micro_batch']['size']} ({r['micro_batch']['chosen_by']}) | {r['tokens_per_s_per_gpu']:,.0f} "
                     f"| {ratio} | {mfu} | {r['peak_gib']:.1f} | {f'{estimate / 2**30:.1f}' if estimate else '-'} |")
    return "\n".join(lines)


def verdict(results: list[dict]) -> str | None:
    base = next((r for r in results if r["gpus"] == 1), None)
    largest = max(results, key=lambda r: r["gpus"])
    if base is None or largest is base:
        return None
    ratio = largest["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    return (f"{largest['gpus']} GPUs at {ratio:.3f} of one GPU's tokens/s per GPU (target >= {TARGET:.2f}): "
            f"{'met' if ratio >= TARGET else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python scripts/bench_scaling.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny")
    p.add_argument("--seq-len", type=int, default=4096 if gpu else 128)
    p.add_argument("--gpus", default="1,2,4,8" if gpu else "1,2", help="launch sizes, comma-separated (GPUs; on CPU, processes)")
    p.add_argument("--micro-batch-size", default="4" if gpu else "2", help="a number, or auto (the memory plan's choice)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per GPU per step")
    p.add_argument("--ds-config", default="ds_configs/zero3_bf16.json")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE", help="model fields, e.g. activation_checkpointing=full")
    add_launch_options(p, steps=10, work_dir="out/bench-scaling")
    args = p.parse_args(argv)
    if args.worker:
        timed_launch_worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return 0
    sizes = [int(s) for s in args.gpus.split(",")]
    if gpu and max(sizes) > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}: this host has {torch.cuda.device_count()} GPU(s)")
    if args.micro_batch_size != "auto" and not args.micro_batch_size.isdigit():
        p.error(f"--micro-batch-size {args.micro_batch_size!r}: a positive number or auto")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    vocab = 4096 if args.preset == "tiny" else 100278
    rows = (4 if args.micro_batch_size == "auto" else int(args.micro_batch_size)) * args.grad_accum
    tokens = (args.warmup + args.steps + 2) * rows * max(sizes) * args.seq_len
    data = generate_shards(work / "shards", tokens, shard_tokens=max(tokens // 4, args.seq_len * 4), vocab_size=vocab,
                           mean_doc_len=min(1200, args.seq_len // 2))
    results = []
    for gpus in sizes:
        config = work / f"gpus{gpus}.yaml"
        config.write_text(yaml.safe_dump(config_tree(args, data, gpus, work), sort_keys=False))
        result = launch_timed("olmo_ds.tools.bench_scaling", config, work / f"gpus{gpus}.json", nproc=gpus,
                              warmup=args.warmup, timeout=args.timeout)
        if result is None:
            return 1
        results.append(result)
        print(f"{gpus} GPU(s): {result['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak {result['peak_gib']:.1f} GiB", flush=True)
    env = results[0]["environment"]
    print(f"\n{args.preset} at {args.seq_len:,} tokens a row, {rows} rows per GPU per step, {env['device']}, "
          f"{args.steps} timed steps after {args.warmup}; torch {env['torch']}, deepspeed {env['deepspeed']}")
    print(table(results))
    if line := verdict(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
