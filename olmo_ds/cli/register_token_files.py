"""Register OLMo's released token files (`.npy`, raw uint16/uint32 ids) as a training source, in place.

    python scripts/register_token_files.py --input 'olmo-mix/**/*.npy' --tokenizer dolma2-tokenizer.json --output data/olmo_mix --workers 16

Writes OUTPUT/manifest.json and small per-file entries over the existing files (no token is
copied), after one parallel scan that refuses out-of-range ids (file and offset), sizes that are no
multiple of the dtype, a wrong dtype and a missing final EOS. Use OUTPUT in `data.sources` like any
shard directory; olmo_ds/data/prepare/token_files.py has the details.

open-instruct's OLMo-core SFT output (token_ids_part_*.npy, labels_mask_part_*.npy, .csv.gz) registers
the same way, masks included (a fine-tuning source):

    python scripts/register_token_files.py --input sft-data/ --tokenizer dolma2-tokenizer.json --output data/sft
"""

import argparse
import sys

from olmo_ds.data.prepare.token_files import TokenFileError, inner_eos_report, register_token_files
from olmo_ds.tokenizer import load_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=".npy token files, directories (recursive) or globs")
    p.add_argument("--tokenizer", required=True, help="the tokenizer the files were made with (vocabulary size, EOS, fingerprint)")
    p.add_argument("--eos-token", default=None, help="the EOS token, if not the tokenizer's own")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None, help="id width (default: uint16 for vocabularies up to 65,536 ids, else uint32, as OLMo writes them)")
    p.add_argument("--output", required=True, help="the source directory to create (must be empty or absent)")
    p.add_argument("--workers", type=int, default=1, help="files scanned in parallel (default: 1)")
    a = p.parse_args(argv)
    try:
        tokenizer = load_tokenizer(a.tokenizer, a.eos_token)
        m = register_token_files(a.input, a.output, tokenizer, a.dtype, a.workers)
    except (TokenFileError, OSError, ValueError) as e:
        print(f"register_token_files: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.output}: {len(m.shards):,} token files in place, {m.num_docs:,} documents, {m.num_tokens:,} tokens ({m.dtype})"
          + (f", loss masks beside them: {m.extra['trained_tokens']:,} trained tokens" if m.masked else ""))
    inner = inner_eos_report(a.output)
    if inner:
        print(f"note: {m.extra['source']['docs_with_inner_eos']:,} documents in {len(inner):,} files hold EOS inside, kept whole as their "
              "index has them (released as they are; validate_shards.py passes them and counts them the same way):")
        print("\n".join(f"  {line}" for line in inner))
    return 0


if __name__ == "__main__":
    sys.exit(main())
