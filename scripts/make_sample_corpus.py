"""Write the demo's embedded corpus (Python standard library docstrings and source) as JSON lines."""

import argparse

from olmo_ds.data.prepare.sample_corpus import write_sample_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", default="data/demo/raw", help="directory for prose.jsonl and code.jsonl.gz")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="total text size to collect")
    args = p.parse_args()
    for name, (docs, nbytes) in write_sample_corpus(args.output, args.max_bytes).items():
        print(f"{args.output}/{name}: {docs} documents, {nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
