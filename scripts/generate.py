"""Generate from a checkpoint or model directory: prompts decoded together in batches, with a KV cache.

    python scripts/generate.py runs/demo/checkpoints/step-0000100 --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py models/olmo2-1b --prompt "The capital of France is" --temperature 0.8 --top-p 0.95
    python scripts/generate.py runs/sft --chat --prompt "Name three primes." [--system "Be brief."] [--chat-template olmo3]
    python scripts/generate.py models/olmo2-1b --prompts prompts.jsonl --batch-size 64 --out completions.jsonl
    python scripts/generate.py runs/first-rl --chat --chat-template olmo3 --prompts data/rl/prompts.jsonl   # RL rows: scored

CHECKPOINT is a training checkpoint, a run dir, an olmo-ds model directory or an export, loaded by
`olmo_ds.weights.load_model`; the tokenizer is the one beside the weights unless --tokenizer is given. Runs on a
GPU in bf16 when one is present, else on CPU in fp32.

--prompts FILE.jsonl: one prompt per line, {"prompt": TEXT} or {"messages": [...]} (chat), optionally with "id",
"max_new_tokens" and "stop" (olmo_ds/model/decode/prompts.py). The completions are written as JSON lines (to --out,
else to stdout), one per prompt in the file's order: the record's id and prompt or messages, "completion" (the new
text, cut before a stop string), "tokens" (how many new ids) and "finish" (eos, stop or length). Progress goes to
stderr. --prompt TEXT (repeatable) prints each prompt and its continuation instead.

RL prompt rows ({"messages": [...], "ground_truth": ..., "dataset": VERIFIER}, as scripts/make_rl_prompts.py and
the public RLVR mixes write them) are answered like any prompt and scored by their verifier
(olmo_ds/eval/verifiers.py, the RL reward): each output line adds "dataset", "ground_truth", "reward" and "reason"
(why the verifier could not score the answer, else null), and stderr ends with a summary line (the solve rate and
mean reward, per verifier). A row with an unknown verifier or a ground truth no answer could match is refused, with
its file and line, before any weight is read.

Decoding (olmo_ds/model/decode/): up to --batch-size sequences at once; a finished one hands its cache slot to the
next prompt. Greedy by default; --temperature with --top-p / --top-k samples, reproducibly per prompt for a --seed
whatever the batch size. A batch whose KV cache cannot fit (the GPU's free memory, or --cache-gib) is refused with
the number of sequences that would fit.

--chat asks a chat model: each prompt becomes a user turn (after a --system turn, if given), rendered with the chat
template and its generation prompt, and encoded as SFT data is (only the template's own markers become special ids;
special-token text typed in a prompt stays text). Generation stops at the end of the assistant's turn (`<|im_end|>`
or the EOS for OLMo 3) and only the reply is printed. The template is the one saved with the weights or their
tokenizer (tokenizer_config.json's chat_template, or chat_template.jinja) unless --chat-template names one: `olmo3`,
a tokenizer_config.json, a directory or a Jinja file.
"""

import argparse
import sys
import time
from pathlib import Path

import orjson
import torch

from olmo_ds.chat import ChatEncoder, load_chat_template
from olmo_ds.eval.rl import Decoding, answer_record, check_rows, metrics, score_answer
from olmo_ds.model.decode import Request, Sampling, check_requests, generate
from olmo_ds.model.decode.prompts import read_prompts, text_prompt
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.weights import chat_template_of, describe_weights, load_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="RUN/checkpoints/step-NNNNNNN, a run dir, an olmo-ds model directory or an export")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    source.add_argument("--prompts", metavar="FILE.jsonl", help="a file of prompts, one JSON object per line")
    p.add_argument("--out", metavar="FILE.jsonl", help="with --prompts: where the completions go (default: stdout); never overwritten")
    p.add_argument("--batch-size", type=int, default=8, help="sequences decoded at once (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per prompt, unless its record says otherwise")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string for every prompt (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely ids (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-gib", type=float, default=None,
                   help="memory the KV cache may take (default: 80%% of the GPU's free memory; 4 GiB on CPU)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json / .model (default: the checkpoint's)")
    p.add_argument("--chat", action="store_true", help="each prompt is a user turn of a conversation with a chat model")
    p.add_argument("--chat-template", default=None, metavar="SPEC",
                   help="with --chat: olmo3, a tokenizer_config.json, a directory or a .jinja file (default: the one beside the weights)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system turn before each prompt")
    args = p.parse_args()
    if not args.chat and (args.chat_template is not None or args.system is not None):
        p.error("--chat-template and --system need --chat")
    if args.out and not args.prompts:
        p.error("--out needs --prompts")
    if args.batch_size < 1 or (args.cache_gib is not None and not args.cache_gib > 0):
        p.error("--batch-size must be >= 1 and --cache-gib > 0")
    if args.out and Path(args.out).exists():
        p.error(f"--out {args.out} exists; completions are never written over a file (remove it or name another)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # everything is checked before any weight is read
        sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        provenance = describe_weights(args.checkpoint)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else provenance.tokenizer
        if tokenizer is None:
            raise FileNotFoundError(f"{provenance.directory}: no tokenizer beside the weights; pass --tokenizer")
        encoder = chat_encoder(args, provenance, tokenizer) if args.chat else None
        if args.prompts:
            prompts = read_prompts(args.prompts, tokenizer, encoder, args.system)
            rl_rows = [pr for pr in prompts if pr.verifier is not None]
            verifiers = dict(zip((pr.where for pr in rl_rows), check_rows([(pr.where, pr.verifier, pr.ground_truth) for pr in rl_rows])))
        else:
            prompts = [text_prompt(text, f"--prompt {n + 1}", tokenizer, encoder, args.system) for n, text in enumerate(args.prompt)]
        stop_ids = encoder.turn_end_ids() if encoder else [tokenizer.eos_id]
        requests = [Request(pr.ids, pr.max_new_tokens or args.max_new_tokens, (*args.stop, *pr.stop)) for pr in prompts]
        check_requests(requests, provenance.cfg, has_tokenizer=True, names=[pr.where for pr in prompts])
        # The weights' own tokenizer goes through load_model's check that a checkpoint's is the one its run trained with.
        model, tokenizer, _ = load_model(provenance, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                         tokenizer=tokenizer if args.tokenizer else None)
        budget = int(args.cache_gib * 2**30) if args.cache_gib is not None else None
        result = generate(model, requests, batch_size=args.batch_size, sampling=sampling, stop_ids=stop_ids, tokenizer=tokenizer,
                          cache_budget=budget, progress=Progress() if args.prompts else None)
    except (FileNotFoundError, ValueError) as e:  # ChatError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompts:
        records, scored = [], []
        for pr, c in zip(prompts, result.completions):
            record = {**pr.echo, "completion": c.text, "tokens": len(c.tokens), "finish": c.finish}
            if pr.verifier is not None:
                score = score_answer(verifiers[pr.where], c.text, pr.ground_truth)
                record.update(dataset=pr.verifier, ground_truth=pr.ground_truth, reward=score["reward"], reason=score["reason"])
                scored.append(answer_record(score))
            records.append(record)
        lines = b"".join(orjson.dumps(r) + b"\n" for r in records)
        if args.out:
            Path(args.out).write_bytes(lines)
        else:
            sys.stdout.buffer.write(lines)
        s = result.stats
        print(f"generate: {s['requests']} prompts, {s['new_tokens']:,} new tokens in {s['seconds']:.1f} s "
              f"({s['new_tokens_per_second']:,.0f} tokens/s), batch {s['batch_size']}, KV cache "
              f"{s['cache_bytes_per_sequence'] / 2**10:,.0f} KiB per sequence" + (f"; written to {args.out}" if args.out else ""),
              file=sys.stderr)
        if scored:
            print(rewards_line(scored, Decoding(args.max_new_tokens, args.batch_size, temperature=args.temperature, seed=args.seed)),
                  file=sys.stderr)
        return 0
    for pr, c in zip(prompts, result.completions):
        text = pr.echo["prompt"]
        print(f"=== {text!r}\n{c.text}\n" if encoder else f"=== {text!r}\n{text}{c.text}\n")
    return 0


def rewards_line(scored: list[dict], decoding: Decoding) -> str:
    """The summary of the RL rows' answers: the solve rate (pass@1 when sampled) and mean reward, then per verifier."""
    m = metrics(scored, decoding)
    rate = "solve_rate" if decoding.greedy else "pass_at_1"
    counts = {v: sum(r["verifier"] == v for r in scored) for v in sorted({r["verifier"] for r in scored})}
    per = "; ".join(f"{v} ({n}): {rate} {m[f'{rate}/{v}']:.3f}, reward {m[f'reward_mean/{v}']:.3f}" for v, n in counts.items())
    return (f"generate: rewards of {len(scored)} RL prompt rows: {rate} {m[rate]:.3f}, reward mean {m['reward_mean']:.3f}"
            f" ({sum(r['solved'] for r in scored)} solved); {per}")


class Progress:
    """Prompts done and tokens/s on stderr, at most every two seconds and once at the end."""

    def __init__(self):
        self.start = self.shown = time.perf_counter()

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.shown >= 2 or done == total:
            self.shown = now
            print(f"generate: {done}/{total} prompts, {tokens:,} new tokens, {tokens / max(now - self.start, 1e-9):,.0f} tokens/s",
                  file=sys.stderr, flush=True)


def chat_encoder(args, provenance, tokenizer) -> ChatEncoder:
    """The template of --chat-template, else the one beside the weights or their tokenizer, as a ChatEncoder."""
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
