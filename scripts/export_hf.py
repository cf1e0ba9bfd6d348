"""Export a checkpoint to a transformers model directory (Olmo2ForCausalLM / Olmo3ForCausalLM).

    python scripts/export_hf.py runs/demo/checkpoints/step-0000100 exports/demo-hf [--dtype bfloat16]

CHECKPOINT is a training checkpoint (its ZeRO shards are consolidated on CPU; no GPU needed) or a
model directory written by scripts/import_hf.py. The result loads with
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` and `AutoTokenizer.from_pretrained(OUT_DIR)`.

A chat model's template is written into OUT_DIR/tokenizer_config.json (`chat_template`), so
`apply_chat_template` works there: the one saved with the weights or their tokenizer
(tokenizer_config.json's chat_template, or chat_template.jinja), or --chat-template SPEC (`olmo3`, a
tokenizer_config.json, a directory or a Jinja file). generation_config.json then stops at the end of
the assistant's turn too (eos_token_id [<|im_end|>, <|endoftext|>] for OLMo 3).
"""

import argparse
import sys

from olmo_ds.weights import DEFAULT_SHARD_BYTES, export_hf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="RUN/checkpoints/step-NNNNNNN or an olmo-ds model directory")
    p.add_argument("out_dir", help="transformers model directory to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the exported weights (default float32: exact)")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1024**3,
                   help="split model.safetensors into shards of at most this size (default 5)")
    p.add_argument("--chat-template", default=None, metavar="SPEC",
                   help="chat template to export: olmo3, a tokenizer_config.json, a directory or a .jinja file "
                        "(default: the one beside the weights, if any)")
    args = p.parse_args()
    try:
        out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1024**3),
                        chat_template=args.chat_template)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
