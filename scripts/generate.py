"""Read samples from a checkpoint: greedy or top-p continuation of prompts, with a KV cache.

    python scripts/generate.py runs/demo/checkpoints/step-0000100 --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py models/olmo2-1b --prompt "The capital of France is" --temperature 0.8 --top-p 0.95
    python scripts/generate.py runs/sft --chat --prompt "Name three primes." [--system "Be brief."] [--chat-template olmo3]

CHECKPOINT is a training checkpoint or an olmo-ds model directory (scripts/import_hf.py), loaded by
`olmo_ds.weights.load_model`; the tokenizer is the one beside the weights unless --tokenizer is given. Runs on a GPU in bf16 when
one is present, else on CPU in fp32.

--chat asks a chat model: each prompt becomes a user turn (after a --system turn, if given), rendered with
the chat template and its generation prompt, and encoded as SFT data is (only the template's own markers
become special ids; special-token text typed in a prompt stays text). Generation stops at the end of the
assistant's turn (`<|im_end|>` or the EOS for OLMo 3) and only the reply is printed. The template is the one
saved with the weights or their tokenizer (tokenizer_config.json's chat_template, or chat_template.jinja)
unless --chat-template names one: `olmo3`, a tokenizer_config.json, a directory or a Jinja file.
"""

import argparse
import sys

import torch

from olmo_ds.chat import ChatEncoder, load_chat_template
from olmo_ds.model.generate import generate
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.weights import chat_template_of, describe_weights, load_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="RUN/checkpoints/step-NNNNNNN or an olmo-ds model directory")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json / .model (default: the checkpoint's)")
    p.add_argument("--chat", action="store_true", help="each prompt is a user turn of a conversation with a chat model")
    p.add_argument("--chat-template", default=None, metavar="SPEC",
                   help="with --chat: olmo3, a tokenizer_config.json, a directory or a .jinja file (default: the one beside the weights)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system turn before each prompt")
    args = p.parse_args()
    if not args.chat and (args.chat_template is not None or args.system is not None):
        p.error("--chat-template and --system need --chat")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    encoder, prompts, stop_ids = None, None, []
    try:
        provenance = describe_weights(args.checkpoint)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        if args.chat:  # the template and the prompts are checked before any weight is read
            encoder = chat_encoder(args, provenance, tokenizer)
            system = [{"role": "system", "content": args.system}] if args.system is not None else []
            prompts = [encoder.encode_prompt([*system, {"role": "user", "content": text}]) for text in args.prompt]
            stop_ids = encoder.turn_end_ids()
        model, tokenizer, _ = load_model(provenance, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                         tokenizer=tokenizer)
        if prompts is None:
            prompts = [tokenizer.encode(text) for text in args.prompt]
        outputs = generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           eos_id=tokenizer.eos_id, stop_ids=stop_ids, seed=args.seed)
    except (FileNotFoundError, ValueError) as e:  # ChatError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text, new in zip(args.prompt, outputs):
        if encoder:
            reply = new[:-1] if new and new[-1] in stop_ids else new
            print(f"=== {text!r}\n{tokenizer.decode(reply)}\n")
        else:
            print(f"=== {text!r}\n{text}{tokenizer.decode(new)}\n")
    return 0


def chat_encoder(args, provenance, tokenizer) -> ChatEncoder:
    """The template of --chat-template, else the one beside the weights or their tokenizer, as a ChatEncoder."""
    tokenizer = tokenizer if tokenizer is not None else provenance.tokenizer
    if tokenizer is None:
        raise FileNotFoundError(f"{provenance.directory}: no tokenizer beside the weights; pass --tokenizer")
    if args.chat_template is not None:
        template = load_chat_template(args.chat_template, tokenizer)
    else:
        template = chat_template_of(provenance, tokenizer)
        if template is None:
            where = sorted({str(provenance.directory), str(tokenizer.path.parent)})
            raise FileNotFoundError(f"no chat template beside the weights or their tokenizer ({', '.join(where)}: no "
                                    "chat_template in tokenizer_config.json, no chat_template.jinja); pass --chat-template "
                                    "olmo3 for OLMo 3's, or a tokenizer_config.json / .jinja file")
    return ChatEncoder(template, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
