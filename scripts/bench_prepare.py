"""Data preparation throughput: each tokenizer backend's raw ceiling vs prepare_data.py + validate_shards.py
end to end at 1 and 2 workers, and where the fast path's time goes.

    python scripts/bench_prepare.py                          # 256 MB generated corpus, OLMo 2/3 tokenizer, both backends
    python scripts/bench_prepare.py --size-mb 16             # a quick run
    python scripts/bench_prepare.py --backends fast          # only fastokens
    python scripts/bench_prepare.py --backends fast --big-file-mb 4000   # and on one 4 GB file: RSS over time, speed

Prints tokens/s, MB/s, peak RSS and the ratios against the targets.
"""

import argparse
import json
from pathlib import Path

from olmo_ds.data.prepare_bench import REPO, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, default=REPO / ".." / "shared" / "tokenizers" / "dolma2-tokenizer.json")
    p.add_argument("--dir", type=Path, default=Path("data/bench-prepare"), help="where the generated corpus and the shards go (corpus reused when present)")
    p.add_argument("--size-mb", type=int, default=256, help="size of the generated corpus (default: 256)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--backends", nargs="+", choices=("hf", "fast"), default=["hf", "fast"])
    p.add_argument("--repeats", type=int, default=1, help="run each prepare this many times and keep the fastest (default: 1)")
    p.add_argument("--big-file-mb", type=int, default=0, help="also run on one file of this many MB: each process's RSS over time at the most workers, and prepare+validate at every worker count (0: skip)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = p.parse_args()
    results = run(a.tokenizer.resolve(), a.dir, a.size_mb, a.workers, a.backends, big_file_mb=a.big_file_mb, repeats=a.repeats)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
