"""Sequence parallelism's throughput and memory on one host: the same training run at several sequence-parallel
sizes, one launch each, and a table of tokens/s per GPU and peak memory against size 1.

    python scripts/bench_sequence_parallel.py                          # GPUs: the OLMo-3-style 1B at 65,536, N = 1, 2, 4 on 4 GPUs
    python scripts/bench_sequence_parallel.py --gpus 8 --sizes 1,2,4,8 --model-set activation_checkpointing=false
    python scripts/bench_sequence_parallel.py --preset tiny --seq-len 256 --gpus 2 --sizes 1,2 --steps 2   # CPU ranks

Every size trains the same model on the same generated rows (document-masked, OLMo 3's sliding windows, YaRN)
with the same global batch, one row per GPU per step (`--gpus` rows: N accumulation steps at size N), through the
real `Trainer` under torchrun, so what is timed is what `scripts/pretrain.py` runs. Tokens/s per GPU is the
step's tokens (each counted once) over its wall time over the GPUs; the peak is the largest
`torch.cuda.max_memory_allocated` of any rank over the timed steps (on CPU ranks: none). Each size's JSON and
log go to the work directory; the table is printed last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

from olmo_ds.tools.harness import add_launch_options, generate_shards, launch_timed, timed_launch_worker


def config_tree(args, data: Path, size: int, work: Path) -> dict:
    gpu = torch.cuda.is_available()
    model = {"preset": args.preset, "max_seq_len": max(args.seq_len, 256)}
    if args.preset != "tiny":
        model["yarn"] = {"factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 8192}
    for assignment in args.model_set:
        key, value = assignment.split("=", 1)
        model[key] = yaml.safe_load(value)
    return {
        "run_dir": str(work / f"run-sp{size}"), "max_steps": args.warmup + args.steps,
        "precision": "bf16" if gpu else "fp32", "model": model,
        "data": {"sources": [{"path": str(data)}], "document_masking": True, "prefetch": 2},
        "batch": {"global_batch_size": args.gpus, "micro_batch_size": 1, "seq_len": args.seq_len},
        "parallel": {"sequence_parallel_size": size},
        "schedule": {"kind": "constant"}, "checkpoint": {"every": 0, "save_final": False},
        "logging": {"every": 1, "tensorboard": False},
    }


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["sequence_parallel_size"] == 1), None)
    lines = ["| N | data-parallel | tokens/s per rank | vs N = 1 | peak GiB (largest rank) |", "|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}" if base else "-"
        lines.append(f"| {r['sequence_parallel_size']} | {r['data_parallel_size']} | {r['tokens_per_s_per_gpu']:,.0f} | {ratio} | "
                     f"{r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python scripts/bench_sequence_parallel.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo3-style-1b" if gpu else "tiny")
    p.add_argument("--seq-len", type=int, default=65536 if gpu else 256)
    p.add_argument("--gpus", type=int, default=4 if gpu else 2, help="ranks of every launch (GPUs; on CPU, processes)")
    p.add_argument("--sizes", default="1,2,4" if gpu else "1,2", help="sequence-parallel sizes, comma-separated")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="model fields, e.g. activation_checkpointing=false (default: the preset's, with YaRN for 65,536)")
    add_launch_options(p, steps=5, work_dir="out/bench-sp")
    args = p.parse_args(argv)
    if args.worker:
        timed_launch_worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    vocab = 4096 if args.preset == "tiny" else 100278
    tokens = (args.warmup + args.steps + 2) * args.gpus * args.seq_len * 2
    data = generate_shards(work / "shards", tokens, shard_tokens=max(tokens // 2, args.seq_len * 4), vocab_size=vocab,
                           mean_doc_len=min(8192, args.seq_len // 2))
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        config = work / f"sp{size}.yaml"
        config.write_text(yaml.safe_dump(config_tree(args, data, size, work), sort_keys=False))
        result = launch_timed("olmo_ds.tools.bench_sequence_parallel", config, work / f"sp{size}.json", nproc=args.gpus,
                              warmup=args.warmup, timeout=args.timeout)
        if result is None:
            return 1
        results.append(result)
        print(f"N = {size}: {results[-1]['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak {results[-1]['peak_gib']:.1f} GiB",
              flush=True)
    env = results[0]["environment"]
    print(f"\n{args.preset} at {args.seq_len:,} tokens a row, {args.gpus} x {env['device']}, "
          f"{args.steps} timed steps after {args.warmup}; torch {env['torch']}, deepspeed {env['deepspeed']}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
