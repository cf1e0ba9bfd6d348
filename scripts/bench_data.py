"""Data loader throughput per rank (tokens/s, instances/s) and its wait share of a simulated GPU step.

    python scripts/bench_data.py                       # 2 GB of generated uint32 shards, seq 4096
    python scripts/bench_data.py --gb 4 --document-masking
    python scripts/bench_data.py --cold                # shards evicted from the page cache first
"""

import argparse
import json
from pathlib import Path

from olmo_ds.data.loader_bench import generate_shards, run


def main() -> None:
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
    args = p.parse_args()
    directory = generate_shards(args.dir, int(args.gb * 2**30) // 4)
    result = run(
        directory, seq_len=args.seq_len, rows_per_rank=args.rows_per_rank, world_size=args.world_size,
        steps=args.steps, document_masking=args.document_masking, gpu_tokens_per_s=args.gpu_tokens_per_s, cold=args.cold,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
