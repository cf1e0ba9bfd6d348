"""Convert between our shard directories and the Megatron-LM / GPT-NeoX indexed format (PREFIX.bin + PREFIX.idx).

    python scripts/convert_shards.py to-megatron data/shards data/megatron/corpus_text_document
    python scripts/convert_shards.py from-megatron data/megatron/corpus_text_document data/shards --tokenizer tokenizer.json

from-megatron needs the tokenizer the ids were made with (vocabulary size, EOS, fingerprint); every
document must end in EOS (Megatron's --append-eod) unless --append-eos adds it.
"""

import argparse
import sys

from olmo_ds.data.prepare.megatron import export_megatron, import_megatron
from olmo_ds.tokenizer import load_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-megatron", help="shard directory → PREFIX.bin + PREFIX.idx (one sequence per document)")
    to.add_argument("directory")
    to.add_argument("prefix")
    frm = sub.add_parser("from-megatron", help="PREFIX.bin + PREFIX.idx → shard directory")
    frm.add_argument("prefix")
    frm.add_argument("directory", help="output shard directory (must be empty or absent)")
    frm.add_argument("--tokenizer", required=True)
    frm.add_argument("--eos-token", default=None)
    frm.add_argument("--shard-tokens", type=int, default=100_000_000)
    frm.add_argument("--append-eos", action="store_true", help="append EOS to every document (data made without --append-eod)")
    a = p.parse_args(argv)
    try:
        if a.command == "to-megatron":
            docs, tokens = export_megatron(a.directory, a.prefix)
            print(f"{a.prefix}.bin/.idx: {docs:,} documents, {tokens:,} tokens")
        else:
            m = import_megatron(a.prefix, a.directory, load_tokenizer(a.tokenizer, a.eos_token), a.shard_tokens, a.append_eos)
            print(f"{a.directory}: {m.num_docs:,} documents, {m.num_tokens:,} tokens in {len(m.shards)} shards ({m.dtype})")
    except (OSError, ValueError) as e:
        print(f"convert_shards: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
