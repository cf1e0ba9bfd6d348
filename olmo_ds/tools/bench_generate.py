"""Generation speed: olmo-ds's batched decoding against transformers' `generate` on the same weights.

    python scripts/bench_generate.py                      # GPU: the 1B, 256 prompts of 128-1024 tokens, 256 new, greedy
    python scripts/bench_generate.py --preset tiny        # CPU: a dry run of every row in seconds

One model of `--preset` (random weights: speed does not depend on them) in bf16 on a GPU (fp32 on CPU), and
the same weights exported in memory to transformers' Olmo2ForCausalLM / Olmo3ForCausalLM (`model/hf.py`
names, its default SDPA attention). Prompts are random ids of uniformly drawn lengths; every sequence gets
exactly `--new-tokens` new tokens (no EOS stops any run), so every row does the same work per prompt.
Rows, each timed after a short warm-up of its engine, with the number of prompts it ran:

- `olmo-ds before #46`: the loop `generate.py` ran before batching (one prompt at a time, a batch-1
  `KVCache`, a whole `OLMo.forward` per token), on `--batch1-prompts` of the prompts;
- `olmo-ds`: `olmo_ds.model.decode.generate` at each of `--batch-sizes` (batch 1 on `--batch1-prompts`), with
  CUDA graphs on a GPU (its default), and on a GPU once more without them (`olmo-ds, eager`) at the largest;
- `transformers`: `generate(do_sample=False)` at the same batch sizes, left-padded batches in prompt order
  (batch 1 on `--batch1-prompts`).

Output tokens/s = new tokens / seconds. The table comes last; `--out` writes the rows as JSON. Greedy outputs of
olmo-ds and transformers are compared on the prompts both ran at batch 1 (identical in fp32; bf16 may differ).
A row that fails is reported as failed (its error on stderr) and the others still run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from olmo_ds.model import KVCache, OLMo, preset
from olmo_ds.model.decode import Request, bytes_per_sequence, generate
from olmo_ds.model.hf import to_hf_config, to_hf_state_dict
from olmo_ds.tools.harness import current_device, environment, timed


def make_prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


@torch.no_grad()
def before_46(model: OLMo, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding as olmo_ds/model/generate.py did it before #46: one prompt at a time, a whole forward per token."""
    cfg, param = model.cfg, next(model.parameters())
    outputs = []
    for prompt in prompts:
        cache = KVCache(cfg, 1, len(prompt) + new_tokens, param.device, param.dtype)
        logits = model(torch.tensor([prompt], device=param.device), cache=cache)[0, -1]
        new = []
        for _ in range(new_tokens):
            new.append(int(logits[:cfg.vocab_size].float().argmax()))
            logits = model(torch.tensor([[new[-1]]], device=param.device), cache=cache)[0, -1]
        outputs.append(new)
    return outputs


def hf_model(model: OLMo):
    """The same weights in transformers' class, on the same device and dtype."""
    import transformers

    param = next(model.parameters())
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(to_hf_config(model.cfg))))
    with torch.device(param.device):  # built where it runs: no second random init of a 1B on the host
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=param.dtype)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.cfg, model.state_dict()), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if model.cfg.tie_embeddings else set()):
        raise ValueError(f"the export's names do not match transformers' model: missing {missing}, unexpected {unexpected}")
    if model.cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


@torch.no_grad()
def hf_generate(hf, prompts: list[list[int]], new_tokens: int, batch_size: int) -> list[list[int]]:
    import transformers

    device = next(hf.parameters()).device
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           eos_token_id=None, pad_token_id=0)
    outputs = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        outputs += out[:, width:].tolist()
    return outputs


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python scripts/bench_generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny", help="model preset, random weights (default: olmo2-1b on GPU, tiny on CPU)")
    p.add_argument("--prompts", type=int, default=256 if gpu else 8, help="prompts of the batched rows")
    p.add_argument("--min-len", type=int, default=128 if gpu else 8)
    p.add_argument("--max-len", type=int, default=1024 if gpu else 40)
    p.add_argument("--new-tokens", type=int, default=256 if gpu else 12)
    p.add_argument("--batch-sizes", default="1,64" if gpu else "1,4", help="comma-separated (olmo-ds and transformers alike)")
    p.add_argument("--batch1-prompts", type=int, default=8 if gpu else 2, help="prompts of the batch-1 rows (the first ones)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false", help="only olmo-ds's rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows and the environment as JSON here")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if not 1 <= args.min_len <= args.max_len or args.new_tokens < 1 or args.prompts < 1 or min(sizes) < 1 or args.batch1_prompts < 1:
        p.error("need 1 <= --min-len <= --max-len, and --new-tokens, --prompts, --batch-sizes, --batch1-prompts >= 1")
    cfg = preset(args.preset, max_seq_len=max(preset(args.preset).max_seq_len, args.max_len + args.new_tokens))
    device, dtype = current_device(), torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(args.seed)
    model = OLMo(cfg).to(device=device, dtype=dtype).eval()
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, cfg.vocab_size, args.seed)
    few = prompts[:args.batch1_prompts]
    print(f"bench_generate: {args.preset} ({dtype}) on {environment()['device']}; {len(prompts)} prompts of {args.min_len}-{args.max_len} "
          f"tokens ({sum(map(len, prompts)):,} in all), {args.new_tokens} new tokens each, greedy; KV cache "
          f"{bytes_per_sequence(cfg, args.max_len + args.new_tokens, dtype) / 2**20:.1f} MiB per sequence", flush=True)

    rows, outputs = [], {}

    def row(engine: str, batch: int, count: int, fn) -> None:
        try:
            out, seconds = timed(fn)
        except (RuntimeError, ValueError) as e:  # a CUDA error, out of memory: the other rows still say something
            print(f"  {engine} batch {batch}: failed: {e}", file=sys.stderr, flush=True)
            rows.append({"engine": engine, "batch": batch, "prompts": count, "failed": str(e)})
            return
        tokens = sum(map(len, out))
        rows.append({"engine": engine, "batch": batch, "prompts": count, "new_tokens": tokens, "seconds": seconds,
                     "tokens_per_second": tokens / seconds})
        outputs[(engine, batch)] = out
        print(f"  {engine} batch {batch}: {count} prompts, {tokens:,} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s", flush=True)

    def ours(subset, b, n, graphs=None):
        return [c.tokens for c in generate(model, [Request(q, n) for q in subset], batch_size=b, cuda_graphs=graphs).completions]

    warm = [q[:16] for q in prompts[:2]]
    before_46(model, warm[:1], 2)
    row("olmo-ds before #46", 1, len(few), lambda: before_46(model, few, args.new_tokens))
    ours(warm, 2, 2)
    for b in sizes:
        subset = few if b == 1 else prompts
        row("olmo-ds", b, len(subset), lambda: ours(subset, b, args.new_tokens))
    if gpu:
        row("olmo-ds, eager", max(sizes), len(prompts), lambda: ours(prompts, max(sizes), args.new_tokens, graphs=False))
    if args.transformers:
        hf = hf_model(model)
        hf_generate(hf, warm, 2, 2)
        for b in sizes:
            subset = few if b == 1 else prompts
            row("transformers", b, len(subset), lambda: hf_generate(hf, subset, args.new_tokens, b))
        same = sum(a == h for a, h in zip(outputs[("olmo-ds", 1)], outputs[("transformers", 1)])) if 1 in sizes else None
        if same is not None:
            print(f"greedy outputs identical to transformers' on {same}/{len(few)} of the batch-1 prompts", flush=True)
    if outputs.get(("olmo-ds", 1)) is not None:
        print(f"olmo-ds batch 1 identical to the loop before #46 on "
              f"{sum(a == b for a, b in zip(outputs[('olmo-ds', 1)], outputs[('olmo-ds before #46', 1)]))}/{len(few)} prompts", flush=True)

    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    base = rows[0]["tokens_per_second"] if rows and rows[0]["engine"] == "olmo-ds before #46" else None
    hf_at = {r["batch"]: r["tokens_per_second"] for r in rows if r["engine"] == "transformers"}
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "environment": environment(), "rows": rows, "failed": failed}, indent=2))
    print("\n| engine | batch | prompts | new tokens | seconds | output tokens/s | vs olmo-ds before #46 | vs transformers, same batch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs_hf = f"{r['tokens_per_second'] / hf_at[r['batch']]:.2f}x" if r["engine"] != "transformers" and r["batch"] in hf_at else "–"
        vs_base = f"{r['tokens_per_second'] / base:.1f}x" if base else "–"
        print(f"| {r['engine']} | {r['batch']} | {r['prompts']} | {r['new_tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_second']:,.0f} | "
              f"{vs_base} | {vs_hf} |")
    for r in failed:
        print(f"| {r['engine']} | {r['batch']} | {r['prompts']} | failed | | | | |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
