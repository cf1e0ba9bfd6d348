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
  CUDA graphs and the compiled step on a GPU (its defaults), and on a GPU at batch 64 (else the largest) once more
  without graphs (`olmo-ds, eager`), without the compiled step (`olmo-ds, not compiled`) and with each single
  decode kernel (`olmo-ds, sdpa attention`, `olmo-ds, triton attention`): `auto` must not be slower than the best;
- `transformers`: `generate(do_sample=False)` at the same batch sizes, left-padded batches in prompt order
  (batch 1 on `--batch1-prompts`).

Output tokens/s = new tokens / seconds. On a GPU each olmo-ds row also gives its decode steps' mean time against their
bytes bound (the weights every step, and each row's own cache entries: `Generation.stats['decode_cache_reads']`, over
the measured copy bandwidth), the host's bookkeeping between steps included. The table comes last; `--out` writes the rows as JSON. Greedy outputs of
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
from olmo_ds.model.decode.attention import triton_available
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
def hf_generate(hf, prompts: list[list[int]], new_tokens: int, batch_size: int, static: bool = False) -> list[list[int]]:
    """transformers' greedy `generate`, left-padded batches in prompt order. `static`: its static cache, which
    transformers' `generate` compiles itself on a GPU (`CompileConfig`: inductor, reduce-overhead = CUDA graphs);
    every batch is then padded to the longest prompt of all, so the cache has one shape and compiles once."""
    import transformers

    device = next(hf.parameters()).device
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           eos_token_id=None, pad_token_id=0,
                                           **({"cache_implementation": "static"} if static else {}))
    outputs = []
    longest = max(map(len, prompts))
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = longest if static else max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        outputs += out[:, width:].tolist()
    return outputs


def weight_bytes(model: OLMo) -> int:
    """Parameter bytes a decode step reads: all but the input embedding (a step reads only its rows), the head
    counted even when tied (it is read whole)."""
    total = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not name.startswith("embed."))
    if model.cfg.tie_embeddings:
        total += model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def decode_bound_s(model: OLMo, stats: dict, bandwidth: float) -> float:
    """Seconds a generation's decode steps (`Generation.stats`) take at best: the bytes they must read (the weights
    each step, and each row's own cache entries) over `bandwidth` bytes/s."""
    param = next(model.parameters())
    entry = 2 * model.cfg.n_kv_heads * model.cfg.head_dim * param.element_size()
    return (stats["decode_forwards"] * weight_bytes(model) + stats["decode_cache_reads"] * entry) / bandwidth


def kv_bytes(cfg, positions: list[int], element_size: int) -> int:
    """Cache bytes a decode step must read: each slot's own keys and values up to its new token (position p reads
    p + 1 entries; a sliding layer at most its window), no shared span, no mask."""
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * element_size
    reads = [min(p + 1, cfg.sliding_window) if cfg.layer_is_sliding(i) else p + 1
             for i in range(cfg.n_layers) for p in positions]
    return per_position * sum(reads)


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """The GPU's measured copy bandwidth, bytes/s (bytes read plus bytes written by a device-to-device copy)."""
    src = torch.randn(int(gib * 2 ** 30) // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeats=10)
    del src, dst
    return 2 * gib * 2 ** 30 / (ms / 1e3)


@torch.no_grad()
def step_rows(model: OLMo, max_len: int, batches: list[int], bandwidth: float, repeats: int = 20, kernel: str = "auto",
              compiled: bool = True) -> list[dict]:
    """A decode step with every slot busy, per batch size and span bucket: slots hold random keys and values and
    sequences of random lengths inside the bucket; the step as the engine runs it (one graph replay, the next
    tokens chosen, read back to the host) against the bytes it must read (`weight_bytes` + `kv_bytes`) over the
    measured copy bandwidth. `compiled`: the step's arithmetic compiled (`decode.compiled`), as the engine runs it."""
    from olmo_ds.model.decode.cache import SPAN_BUCKET, SlotCache
    from olmo_ds.model.decode.compiled import CompiledStep
    from olmo_ds.model.decode.graphs import DecodeGraphs
    from olmo_ds.model.decode.sampling import Sampling, next_tokens

    cfg, param = model.cfg, next(model.parameters())
    weights, rows = weight_bytes(model), []
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        cache = SlotCache(cfg, batch, max_len, param.device, param.dtype, kernel, scratch=True)
        for t in cache.keys + cache.values:
            t.normal_()
        graphs = DecodeGraphs(model, cache, CompiledStep(model) if compiled else None)
        slots = list(range(batch))
        for span in range(SPAN_BUCKET, max_len + SPAN_BUCKET, SPAN_BUCKET):
            span = min(span, max_len)
            low = span - SPAN_BUCKET if span % SPAN_BUCKET == 0 else span // SPAN_BUCKET * SPAN_BUCKET
            positions = torch.randint(low, span, (batch,), generator=g)
            ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g).to(param.device)
            pos = positions.to(param.device)

            def step():
                logits = graphs.logits(ids, pos, slots, span)
                return next_tokens(logits, cfg.vocab_size, Sampling(), [None] * batch)[0].tolist()

            step()  # the capture
            graph_ms = median_ms(lambda: graphs.graphs[(batch, span, cache.kernel == "sdpa")][0].replay(), repeats)
            step_ms = median_ms(step, repeats)
            kv = kv_bytes(cfg, positions.tolist(), param.element_size())
            bound_ms = (weights + kv) / bandwidth * 1e3
            rows.append({"kernel": cache.kernel, "compiled": bool(graphs.step and graphs.step.enabled), "batch": batch, "span": span, "mean_length": float(positions.float().mean()) + 1,
                         "weight_bytes": weights, "kv_bytes": kv, "bound_ms": bound_ms, "graph_ms": graph_ms,
                         "step_ms": step_ms, "step_over_bound": step_ms / bound_ms,
                         "tokens_per_second": batch / step_ms * 1e3})
            print(f"  step {cache.kernel}{'' if graphs.step and graphs.step.enabled else ' (not compiled)'} batch {batch} span {span}: bound {bound_ms:.2f} ms, graph {graph_ms:.2f} ms, step {step_ms:.2f} ms "
                  f"({step_ms / bound_ms:.2f}x)", flush=True)
        del cache, graphs
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def profile(model: OLMo, max_len: int, batch: int, prompts: list[list[int]], out_dir: Path, top: int = 15, kernel: str = "auto") -> None:
    """torch.profiler over a prefill wave (prompts laid end to end up to 32K tokens, as the engine does), a few
    eager decode steps at `batch` and the longest span, and a few graph replays of the same step. Writes each
    table (kernels by total GPU time) and a Chrome trace under `out_dir`; prints the top of each."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from olmo_ds.model.decode.cache import SlotCache, decode_span
    from olmo_ds.model.decode.compiled import CompiledStep
    from olmo_ds.model.decode.forward import forward_logits
    from olmo_ds.model.decode.graphs import DecodeGraphs
    from olmo_ds.model.decode.sampling import Sampling, next_tokens

    cfg, param = model.cfg, next(model.parameters())
    device = param.device
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = SlotCache(cfg, batch, max_len, device, param.dtype, kernel, scratch=True)
    step = CompiledStep(model)
    wave, total = [], 0
    for q in prompts:
        if len(wave) == batch or total + len(q) > 32768:
            break
        wave.append(q)
        total += len(q)
    lengths = [len(q) for q in wave]
    ids = torch.tensor([[t for q in wave for t in q]], device=device)
    positions = torch.tensor([[p for n in lengths for p in range(n)]], device=device)
    last = torch.tensor(lengths, device=device).cumsum(0) - 1

    def prefill():
        cache.prefill(list(range(len(wave))), lengths)
        return next_tokens(forward_logits(model, ids, positions, cache, last), cfg.vocab_size, Sampling(), [None] * len(wave))[0].tolist()

    for t in cache.keys + cache.values:
        t.normal_()
    pos = torch.full((batch,), max_len - 2, device=device)
    dec_ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    slots = torch.arange(batch, device=device)
    span = decode_span(max_len - 1, max_len)

    def eager_step():
        cache.decode(slots, pos, span, contiguous=cache.kernel == "sdpa")
        logits = forward_logits(model, dec_ids, pos[:, None], cache, slots, step)
        return next_tokens(logits, cfg.vocab_size, Sampling(), [None] * batch)[0].tolist()

    graphs = DecodeGraphs(model, cache, step)

    def graph_step():
        return next_tokens(graphs.logits(dec_ids, pos, list(range(batch)), span), cfg.vocab_size, Sampling(), [None] * batch)[0].tolist()

    for name, fn, times in ((f"prefill wave of {len(wave)} prompts, {total} tokens, {cache.kernel}", prefill, 2),
                            (f"eager decode step (compiled arithmetic), batch {batch}, span {span}, {cache.kernel}", eager_step, 5),
                            (f"graph decode step, batch {batch}, span {span}, {cache.kernel}", graph_step, 5)):
        wall = median_ms(fn, repeats=5, warmup=2)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(times):
                fn()
            torch.cuda.synchronize()
        tag = name.split(",")[0].replace(" ", "_") + "_" + cache.kernel
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
        (out_dir / f"profile_{tag}.txt").write_text(f"{name}, {times} times\n{table}\n")
        prof.export_chrome_trace(str(out_dir / f"trace_{tag}.json"))
        gpu_total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / times / 1e3
        print(f"\nprofile: {name}: {wall:.2f} ms a call (wall), {gpu_total:.2f} ms of GPU kernels; the top kernels (ms per call, share):", flush=True)
        kernels = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:top]
        for e in kernels:
            ms = getattr(e, "self_device_time_total", 0) / times / 1e3
            if ms > 0:
                print(f"  {ms:7.3f} ms {ms / max(gpu_total, 1e-9):5.1%}  x{e.count // times:<4} {e.key[:110]}", flush=True)
    del cache, graphs
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python scripts/bench_generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny", help="model preset, random weights (default: olmo2-1b on GPU, tiny on CPU)")
    p.add_argument("--prompts", type=int, default=256 if gpu else 8, help="prompts of the batched rows")
    p.add_argument("--min-len", type=int, default=128 if gpu else 8)
    p.add_argument("--max-len", type=int, default=1024 if gpu else 40)
    p.add_argument("--new-tokens", type=int, default=256 if gpu else 12)
    p.add_argument("--batch-sizes", default="1,64" if gpu else "1,4", help="comma-separated (olmo-ds and transformers alike)")
    p.add_argument("--hf-batch-sizes", default="1,64" if gpu else "1,4", help="comma-separated: transformers' rows")
    p.add_argument("--batch1-prompts", type=int, default=8 if gpu else 2, help="prompts of the batch-1 rows (the first ones)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false", help="only olmo-ds's rows")
    p.add_argument("--no-before-46", dest="before_46", action="store_false", help="leave out the loop before #46 (slow)")
    p.add_argument("--no-eager", dest="eager", action="store_false", help="leave out olmo-ds without CUDA graphs")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="GPU: time the step table without the compiled step, and leave out the 'not compiled' row")
    p.add_argument("--no-static", dest="static", action="store_false",
                   help="leave out transformers with its static cache (compiled by transformers on a GPU; a minute of compiling)")
    p.add_argument("--steps", default="1,64,256" if gpu else "",
                   help="GPU: comma-separated batch sizes whose decode step is timed per span bucket against the bytes it "
                        "must read over the measured copy bandwidth ('' = none)")
    p.add_argument("--kernels", default="auto", help="comma-separated decode attention kernels (auto, sdpa, triton) of the "
                   "step table and the profile; the batched rows use auto, and on a GPU add an sdpa row at batch 64")
    p.add_argument("--profile", metavar="DIR", help="GPU: torch.profiler tables and traces of a prefill wave and of decode "
                                                     "steps at the largest batch size, written here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows and the environment as JSON here")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
        hf_sizes = [int(s) for s in args.hf_batch_sizes.split(",")]
        step_sizes = [int(s) for s in args.steps.split(",")] if args.steps else []
    except ValueError:
        p.error(f"--batch-sizes and --steps are comma-separated integers, got {args.batch_sizes!r} and {args.steps!r}")
    if (step_sizes or args.profile) and not gpu:
        p.error("--steps and --profile time a GPU's decode step: there is no GPU here (pass --steps '')")
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
    decode = {}  # the last olmo-ds run's decode step time and bytes bound, for its row
    bandwidth = copy_bandwidth(device) if gpu else None
    if gpu:
        print(f"copy bandwidth (read + write of a 2 GiB device copy): {bandwidth / 1e12:.2f} TB/s; weights read per step "
              f"{weight_bytes(model) / 1e9:.2f} GB", flush=True)

    def row(engine: str, batch: int, count: int, fn) -> None:
        decode.clear()
        try:
            out, seconds = timed(fn)
        except (RuntimeError, ValueError) as e:  # a CUDA error, out of memory: the other rows still say something
            print(f"  {engine} batch {batch}: failed: {e}", file=sys.stderr, flush=True)
            rows.append({"engine": engine, "batch": batch, "prompts": count, "failed": str(e)})
            return
        tokens = sum(map(len, out))
        rows.append({"engine": engine, "batch": batch, "prompts": count, "new_tokens": tokens, "seconds": seconds,
                     "tokens_per_second": tokens / seconds, **decode})
        outputs[(engine, batch)] = out
        print(f"  {engine} batch {batch}: {count} prompts, {tokens:,} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s", flush=True)

    def ours(subset, b, n, graphs=None, attention="auto", compile=None):
        result = generate(model, [Request(q, n) for q in subset], batch_size=b, cuda_graphs=graphs, attention=attention, compile=compile)
        st = result.stats
        print(f"    olmo-ds batch {b} ({st['attention']} attention{', compiled' if st['compiled'] else ''}"
              f"{', varlen prefill' if st['varlen_prefill'] else ''}): {st['prefill_forwards']} prefill forwards in {st['prefill_seconds']:.2f} s, "
              f"{st['decode_forwards']} decode steps in {st['decode_seconds']:.2f} s "
              f"({st['decode_seconds'] / max(st['decode_forwards'], 1) * 1e3:.2f} ms a step, {st['graph_forwards']} replayed)", flush=True)
        if bandwidth and st["decode_forwards"]:
            bound = decode_bound_s(model, st, bandwidth)
            decode.update(decode_ms=st["decode_seconds"] / st["decode_forwards"] * 1e3, decode_bound_ms=bound / st["decode_forwards"] * 1e3,
                          decode_over_bound=st["decode_seconds"] / bound)
            print(f"    decode steps against their bytes bound: {decode['decode_ms']:.2f} ms a step, bound {decode['decode_bound_ms']:.2f} ms "
                  f"({decode['decode_over_bound']:.2f}x; the host's bookkeeping and padded rows included)", flush=True)
        return [c.tokens for c in result.completions]

    max_len = args.max_len + args.new_tokens
    steps = []
    if step_sizes:
        for k in args.kernels.split(","):
            try:
                steps += step_rows(model, max_len, step_sizes, bandwidth, kernel=k, compiled=args.compile)
            except (RuntimeError, ValueError) as e:  # a kernel that fails to build: the other rows still say something
                print(f"  step {k}: failed: {e}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    if args.profile:
        for k in args.kernels.split(","):
            try:
                profile(model, max_len, 64 if 64 in sizes else max(sizes), prompts, Path(args.profile), kernel=k)
            except (RuntimeError, ValueError) as e:
                print(f"  profile {k}: failed: {e}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    warm = [q[:16] for q in prompts[:2]]
    if args.before_46:
        before_46(model, warm[:1], 2)
        row("olmo-ds before #46", 1, len(few), lambda: before_46(model, few, args.new_tokens))
    ours(warm, 2, 2)  # the compiled step's compiles (rows marked dynamic) and the kernels' builds, outside the timed rows
    ours(warm[:1], 1, 2)  # a single row is a graph of its own
    if gpu:
        ours(warm, 2, 2, attention="sdpa")
    for b in sizes:
        subset = few if b == 1 else prompts
        row("olmo-ds", b, len(subset), lambda: ours(subset, b, args.new_tokens))
    main_batch = 64 if 64 in sizes else max(sizes)
    if gpu:
        if args.eager:
            row("olmo-ds, eager", main_batch, len(prompts), lambda: ours(prompts, main_batch, args.new_tokens, graphs=False))
        if args.compile:
            row("olmo-ds, not compiled", main_batch, len(prompts), lambda: ours(prompts, main_batch, args.new_tokens, compile=False))
        for k in [k for k in ("sdpa", "triton") if k != "triton" or triton_available()]:
            row(f"olmo-ds, {k} attention", main_batch, len(prompts), lambda: ours(prompts, main_batch, args.new_tokens, attention=k))
    if args.transformers:
        hf = hf_model(model)
        hf_generate(hf, warm, 2, 2)
        if gpu and args.static:
            b = main_batch
            # The compile (and the CUDA graphs' capture) happens in the first call: a warm-up on the first batch.
            try:
                _, seconds = timed(lambda: hf_generate(hf, prompts[:b], args.new_tokens, b, static=True))
                print(f"  transformers, static cache: warm-up (compiling) on one batch of {b}: {seconds:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - the compile's errors are of many kinds; the row below reports it again
                print(f"  transformers, static cache: warm-up failed: {e}", file=sys.stderr, flush=True)
            row("transformers, static cache", b, len(prompts), lambda: hf_generate(hf, prompts, args.new_tokens, b, static=True))
        for b in hf_sizes:
            subset = few if b == 1 else prompts
            row("transformers", b, len(subset), lambda: hf_generate(hf, subset, args.new_tokens, b))
        same = sum(a == h for a, h in zip(outputs[("olmo-ds", 1)], outputs[("transformers", 1)])) if 1 in sizes and 1 in hf_sizes else None
        if same is not None:
            print(f"greedy outputs identical to transformers' on {same}/{len(few)} of the batch-1 prompts", flush=True)
    if outputs.get(("olmo-ds", 1)) is not None and outputs.get(("olmo-ds before #46", 1)) is not None:
        print(f"olmo-ds batch 1 identical to the loop before #46 on "
              f"{sum(a == b for a, b in zip(outputs[('olmo-ds', 1)], outputs[('olmo-ds before #46', 1)]))}/{len(few)} prompts", flush=True)

    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    base = rows[0]["tokens_per_second"] if rows and rows[0]["engine"] == "olmo-ds before #46" else None
    hf_at = {r["batch"]: r["tokens_per_second"] for r in rows if r["engine"] == "transformers"}
    static_at = {r["batch"]: r["tokens_per_second"] for r in rows if r["engine"] == "transformers, static cache"}
    ours_at = {r["batch"]: r["tokens_per_second"] for r in rows if r["engine"] == "olmo-ds"}
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "environment": environment(), "rows": rows, "failed": failed,
                                              "steps": steps}, indent=2))
    if steps:
        print("\nDecode step, every slot busy (graph replay, next tokens, read back), against the bytes it must read "
              "(weights + each slot's own keys and values) over the measured copy bandwidth:")
        print("| kernel | batch | span bucket | mean length | bytes read GB | bound ms | graph ms | step ms | step / bound | tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in steps:
            print(f"| {r['kernel']}{'' if r['compiled'] else ' (not compiled)'} | {r['batch']} | {r['span']} | {r['mean_length']:.0f} | {(r['weight_bytes'] + r['kv_bytes']) / 1e9:.2f} | "
                  f"{r['bound_ms']:.2f} | {r['graph_ms']:.2f} | {r['step_ms']:.2f} | {r['step_over_bound']:.2f}x | {r['tokens_per_second']:,.0f} |")
    print("\n| engine | batch | prompts | new tokens | seconds | output tokens/s | decode step / bytes bound | vs olmo-ds before #46 "
          "| vs transformers, same batch | vs transformers static, same batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mine = not r["engine"].startswith("transformers")
        vs_hf = f"{r['tokens_per_second'] / hf_at[r['batch']]:.2f}x" if mine and r["batch"] in hf_at else "–"
        vs_static = f"{r['tokens_per_second'] / static_at[r['batch']]:.2f}x" if mine and r["batch"] in static_at else "–"
        vs_base = f"{r['tokens_per_second'] / base:.1f}x" if base else "–"
        vs_bound = f"{r['decode_ms']:.2f} / {r['decode_bound_ms']:.2f} ms = {r['decode_over_bound']:.2f}x" if "decode_ms" in r else "–"
        print(f"| {r['engine']} | {r['batch']} | {r['prompts']} | {r['new_tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_second']:,.0f} | "
              f"{vs_bound} | {vs_base} | {vs_hf} | {vs_static} |")
    kernel_rows = {r["engine"]: r["tokens_per_second"] for r in rows if r["engine"] in ("olmo-ds, sdpa attention", "olmo-ds, triton attention")}
    if kernel_rows and main_batch in ours_at:
        best = max(kernel_rows, key=kernel_rows.get)
        print(f"olmo-ds auto at batch {main_batch}: {ours_at[main_batch] / kernel_rows[best]:.2f}x the best single kernel's end to end "
              f"({best}, {kernel_rows[best]:,.0f} tokens/s)")
    if 64 in ours_at and max(sizes) > 64:
        print(f"olmo-ds batch {max(sizes)}: {ours_at[max(sizes)] / ours_at[64]:.2f}x the tokens/s of batch 64")
    for r in failed:
        print(f"| {r['engine']} | {r['batch']} | {r['prompts']} | failed | | | | | | |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
