"""Read samples from a checkpoint: greedy or top-p continuation of prompts, with a KV cache.

    python scripts/generate.py runs/demo/checkpoints/step-0000100 --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py models/olmo2-1b --prompt "The capital of France is" --temperature 0.8 --top-p 0.95

CHECKPOINT is a training checkpoint or an olmo-ds model directory (scripts/import_hf.py), loaded by
`olmo_ds.weights.load_model`; the tokenizer is the one beside the weights unless --tokenizer is given. Runs on a GPU in bf16 when
one is present, else on CPU in fp32.
"""

import argparse
import sys

import torch

from olmo_ds.model.generate import generate
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.weights import load_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="RUN/checkpoints/step-NNNNNNN or an olmo-ds model directory")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json / .model (default: the checkpoint's)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, tokenizer, _ = load_model(args.checkpoint, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                         tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [tokenizer.encode(text) for text in args.prompt]
    try:
        outputs = generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           eos_id=tokenizer.eos_id, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text, new in zip(args.prompt, outputs):
        print(f"=== {text!r}\n{text}{tokenizer.decode(new)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
