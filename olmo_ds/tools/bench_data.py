"""Data loader throughput per rank (tokens/s, instances/s) and its wait share of a simulated GPU step.

    python scripts/bench_data.py                       # 2 GB of generated uint32 shards, seq 4096
    python scripts/bench_data.py --gb 4 --document-masking
    python scripts/bench_data.py --cold                # shards evicted from the page cache first
    python scripts/bench_data.py --gb 0.5 --files 20,2000   # the same tokens in 20 files and in 2,000

Throughput of the training data loader: tokens/s one rank receives, and its wait share of a step.

Two measurements on generated shards (random ids, documents of geometric length):
- raw: `next_batch` with no prefetch thread, i.e. what one CPU core assembles per second for one rank
  (from the page cache, or with `cold` from the disk);
- overlapped: with the prefetch thread, while the consumer spends a simulated GPU step per batch
  (`gpu_tokens_per_s` per rank); the loader's wait share of step time is what the trainer would log.

With `--files`, the raw rate instead for the same tokens cut into each number of files (issue 36:
OLMo 3's mix registers ~900 token files): rounds alternate between the file counts, so load from
other processes on the machine falls on each alike, and the medians are compared; each loader's
open file descriptors are counted too (none per file: `olmo_ds.data.shards.map_file`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader
from olmo_ds.tools.harness import generate_shards


def evict_from_page_cache(directory: Path) -> None:
    """Drop the shards' pages from the OS page cache (only these files'), so reads go to the disk."""
    for path in shards.list_shards(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(directory: Path, *, seq_len: int, rows_per_rank: int, world_size: int, steps: int, document_masking: bool, gpu_tokens_per_s: float, cold: bool = False) -> dict:
    """Measure rank 0 of a `world_size`-rank job (its rows are spread over the whole data set).

    `cold`: evict the shards from the page cache first, so every instance is a random read from disk.
    """
    def make(prefetch: int) -> DataLoader:
        cfg = DataConfig(sources=[SourceConfig(path=str(directory))], document_masking=document_masking, prefetch=prefetch)
        return DataLoader(cfg, seq_len=seq_len, global_batch_size=rows_per_rank * world_size, dp_rank=0, dp_world_size=world_size)

    tokens_per_batch = rows_per_rank * seq_len
    raw = make(prefetch=0)
    raw.next_batch()  # build the epoch's order outside the timing
    if cold:
        evict_from_page_cache(directory)
    t0 = time.perf_counter()
    for _ in range(steps):
        raw.next_batch()
    raw_s = time.perf_counter() - t0

    step_s = tokens_per_batch / gpu_tokens_per_s
    over = make(prefetch=2)
    over.next_batch()
    over.wait_seconds = 0.0
    t0 = time.perf_counter()
    overlapped_steps = max(10, min(steps, int(5.0 / step_s)))  # about 5 s of simulated GPU time
    for _ in range(overlapped_steps):
        over.next_batch()
        time.sleep(step_s)
    wall = time.perf_counter() - t0
    over.close()
    return {
        "tokens": raw.sources[0].num_tokens,
        "seq_len": seq_len,
        "rows_per_rank": rows_per_rank,
        "world_size": world_size,
        "document_masking": document_masking,
        "page_cache": "cold" if cold else "warm",
        "instances_per_s": steps * rows_per_rank / raw_s,
        "tokens_per_s": steps * tokens_per_batch / raw_s,
        "simulated_gpu_tokens_per_s": gpu_tokens_per_s,
        "wait_fraction": over.wait_seconds / wall,
    }


def compare_file_counts(root: Path, counts: list[int], total_tokens: int, *, seq_len: int, rows_per_rank: int, world_size: int,
                        steps: int, rounds: int, document_masking: bool) -> dict:
    """The raw rate (`next_batch`, no prefetch thread) over the same number of tokens in each of `counts` files.

    Rounds alternate between the file counts (`steps` batches each); per count: the median tokens/s
    (wall clock, and per CPU second of this thread, which other processes' load disturbs less), its
    ratio to the first count's, and the file descriptors the process holds after opening it.
    """
    loaders, held = {}, {}
    for n in counts:
        directory = generate_shards(Path(root) / f"files-{n}", total_tokens, shard_tokens=math.ceil(total_tokens / n))
        before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
        cfg = DataConfig(sources=[SourceConfig(path=str(directory))], document_masking=document_masking, prefetch=0)
        loaders[n] = DataLoader(cfg, seq_len=seq_len, global_batch_size=rows_per_rank * world_size, dp_rank=0, dp_world_size=world_size)
        held[n] = len(os.listdir("/proc/self/fd")) - before if before >= 0 else None
        loaders[n].next_batch()  # the epoch's order, outside the timing
    rates: dict[int, list[float]] = {n: [] for n in counts}
    cpu_rates: dict[int, list[float]] = {n: [] for n in counts}
    tokens = steps * rows_per_rank * seq_len
    for _ in range(rounds):
        for n in counts:
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                loaders[n].next_batch()
            rates[n].append(tokens / (time.perf_counter() - t0))
            cpu_rates[n].append(tokens / (time.thread_time() - c0))
    base, cpu_base = statistics.median(rates[counts[0]]), statistics.median(cpu_rates[counts[0]])
    return {
        "tokens": total_tokens, "seq_len": seq_len, "rows_per_rank": rows_per_rank, "world_size": world_size,
        "document_masking": document_masking, "steps_per_round": steps, "rounds": rounds,
        "files": {
            str(n): {
                "shards": len(loaders[n].sources[0].metas),
                "open_fds_after_opening": held[n],
                "tokens_per_s_median": statistics.median(rates[n]),
                "tokens_per_s_rounds": [round(r) for r in rates[n]],
                "ratio_to_first": statistics.median(rates[n]) / base,
                # per CPU second of the loading thread: what the loader costs, whatever else the machine runs
                "tokens_per_cpu_s_median": statistics.median(cpu_rates[n]),
                "cpu_ratio_to_first": statistics.median(cpu_rates[n]) / cpu_base,
            }
            for n in counts
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("data/bench-loader"), help="where the generated shards go (reused when present)")
    p.add_argument("--gb", type=float, default=2.0, help="size of the generated shards (uint32 ids: 4 bytes a token)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--rows-per-rank", type=int, default=8, help="rows of each global batch one rank receives")
    p.add_argument("--world-size", type=int, default=8, help="ranks sharing each global batch (rank 0 is measured)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--document-masking", action="store_true", help="also return doc_lens")
    p.add_argument("--cold", action="store_true", help="evict the shards from the page cache first (reads hit the disk)")
    p.add_argument("--gpu-tokens-per-s", type=float, default=60_000, help="simulated consumption per rank")
    p.add_argument("--files", default=None, metavar="N,M,...",
                   help="compare the raw rate over the same tokens (--gb) cut into N, M, ... files (generated under --dir)")
    p.add_argument("--rounds", type=int, default=7, help="with --files: alternating rounds of --steps batches per file count")
    args = p.parse_args(argv)
    if args.files:
        result = compare_file_counts(
            args.dir, [int(n) for n in args.files.split(",")], int(args.gb * 2**30) // 4, seq_len=args.seq_len,
            rows_per_rank=args.rows_per_rank, world_size=args.world_size, steps=args.steps, rounds=args.rounds,
            document_masking=args.document_masking,
        )
        print(json.dumps(result, indent=2))
        return 0
    directory = generate_shards(args.dir, int(args.gb * 2**30) // 4)
    result = run(
        directory, seq_len=args.seq_len, rows_per_rank=args.rows_per_rank, world_size=args.world_size,
        steps=args.steps, document_masking=args.document_masking, gpu_tokens_per_s=args.gpu_tokens_per_s, cold=args.cold,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
