"""Write a masked shard directory (prepare_data.py --format chat) in open-instruct's OLMo-core SFT layout.

    python scripts/export_olmocore_sft.py data/sft --output sft-olmocore --tokenizer dolma2-tokenizer.json --shuffle-seed 42

OUTPUT gets token_ids_part_XXXX.npy (raw ids, no header), labels_mask_part_XXXX.npy (one byte per
token, 1 = trained), token_ids_part_XXXX.csv.gz (start,end per conversation), a new part every
1 GiB of ids, tokenizer/ (with the chat template in tokenizer_config.json) and
dataset_statistics.json: what OLMo-core's SFT scripts read. --shuffle-seed 42 gives the order
open-instruct's converter writes (its default); without it, the shards' order. The other way:
scripts/register_token_files.py. Details: olmo_ds/data/prepare/olmocore.py, docs/data.md.
"""

import argparse
import sys

from olmo_ds.data.prepare.olmocore import PART_BYTES, ExportError, export_olmocore
from olmo_ds.tokenizer import load_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a masked shard directory (prepare_data.py --format chat)")
    p.add_argument("--output", required=True, help="the directory to create (must be empty or absent)")
    p.add_argument("--tokenizer", default=None, help="the tokenizer the shards were made with (default: the one their manifest names), copied to OUTPUT/tokenizer/")
    p.add_argument("--shuffle-seed", type=int, default=None, metavar="SEED", help="write the conversations in numpy.random.default_rng(SEED).permutation order, as open-instruct's converter does (its default: 42); default: the shards' order")
    p.add_argument("--part-bytes", type=int, default=PART_BYTES, help=argparse.SUPPRESS)  # tests: small parts
    a = p.parse_args(argv)
    try:
        tokenizer = load_tokenizer(a.tokenizer) if a.tokenizer else None
        stats = export_olmocore(a.source, a.output, tokenizer, a.shuffle_seed, a.part_bytes)
    except (ExportError, OSError, ValueError) as e:
        print(f"export_olmocore_sft: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.output}: {stats['total_instances']:,} conversations, {stats['total_tokens']:,} tokens, "
          f"{stats['trainable_tokens']:,} trainable ({stats['trainable_percentage']:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
