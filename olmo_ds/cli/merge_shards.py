"""Join the part directories of `prepare_data.py --partition I/M` into one shard directory.

    python scripts/merge_shards.py parts/part-* --output data/shards

The result is what one machine would have written: the same `.bin` and `.offsets.npy` bytes, data
fingerprint, validation split and skip counts (olmo_ds/data/prepare/partition.py says exactly what is
identical). Refuses, naming the part directory, parts that are incomplete, duplicate, missing, or
from another command (input list, M, tokenizer, arguments or olmo-ds version). Rerun after a kill.
"""

import argparse
import sys

from olmo_ds.data.prepare.partition import MergeError, format_merge_summary, merge_parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", help="the M part directories (each the --output of one prepare_data.py --partition I/M)")
    p.add_argument("--output", required=True, help="the merged shard directory (created; must be empty, or an unfinished merge of the same parts)")
    a = p.parse_args(argv)
    try:
        result = merge_parts(a.parts, a.output)
    except MergeError as e:
        print(f"merge_shards: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a full disk, a vanished part: rerunning restarts the merge
        print(f"merge_shards: error: {e}. Rerun the same command to restart the merge", file=sys.stderr)
        return 1
    print(format_merge_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
