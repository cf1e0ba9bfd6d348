"""Evaluation speed, `batching: exact` (the earlier path) against `packed`, in one process and one call.

    python scripts/bench_eval.py                       # GPU: olmo2-1b, bf16, arc_easy + piqa (all items), ~5 min on an H200
    python scripts/bench_eval.py --preset tiny --limit 4 --ppl-rows 4 --seq-len 128   # CPU smoke run, seconds

What is measured, on a randomly initialised model of the preset (speed does not depend on the weights):

1. In the training loop: a `Trainer` (DeepSpeed engine with the chosen ZeRO config, ZeRO-3 by default,
   on one device; compiled leaf blocks on a GPU) and its own `InLoopEvaluator`, configured for the tasks,
   all questions, no unconditional requests. The evaluator is called `--inloop-evals` times: the first
   call includes compiling the scoring graphs (reported apart), the rest are the steady state. This
   runs first, so its first call compiles from scratch as a training run's would.
2. Offline multiple choice (what `scripts/eval.sh` runs) on a plain model in the run's precision:
   `exact` once (no compile to amortize), `packed` once to compile and `--repeats` times timed.
3. Offline perplexity on generated token rows of `--seq-len` (random ids), the same two ways.
4. Precision: the packed bf16 scores of every request against an fp32 reference (the same fp32 weights,
   eager blocks, SDPA, no TF32), and on the first `--cpu-questions` questions of each task against
   fp32 on the CPU through the exact path (the reference the equality tests use): per-request
   |delta log-likelihood| and each accuracy's change.

Units (docs/evaluation.md): requests/s; request tokens/s = context + continuation of every request,
what lm-eval users count; forward tokens/s = every position the model ran, padding included. For
perplexity, tokens/s = labelled targets per second (the training loss's tokens).

The report ends with a short table; `--json` writes everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from olmo_ds.data import shards
from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.perplexity import evaluate_perplexity, token_byte_lengths, window_batches
from olmo_ds.eval.tasks import load_task
from olmo_ds.model import OLMo
from olmo_ds.model.config import preset
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.tools.harness import block_counts, current_device, dynamo_graphs, environment, timed
from olmo_ds.train.config import config_from_dict
from olmo_ds.train.launch import normalize_cuda_arch_list
from olmo_ds.train.metrics import setup_console_logging
from olmo_ds.train.trainer import Trainer

GPU = torch.cuda.is_available()


def _shared() -> Path:
    """Shared test data: $OLMO_DS_SHARED, else `shared/` beside the repository (as tests/testdata.py)."""
    env = os.environ.get("OLMO_DS_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared"


@dataclass
class EvalBenchOptions:
    preset: str = "olmo2-1b"
    tasks: list[str] = field(default_factory=list)  # default: shared arc_easy_rc_0shot and piqa_rc_0shot
    tokenizer: str | None = None  # default: shared dolma2-tokenizer.json
    limit: int | None = None  # questions per task (None = all)
    batch_tokens: int = 32768  # positions per forward, offline (eval.sh's GPU default)
    seq_len: int = 4096  # perplexity rows; the in-loop run's batch.seq_len
    ppl_rows: int = 64
    repeats: int = 2  # timed runs of the packed path after its first call
    precision: str | None = None  # bf16 on GPU, fp32 on CPU
    inloop: bool = True
    inloop_evals: int = 3
    inloop_exact: bool = False  # also time the in-loop evaluator with batching exact (slow: today's path)
    micro_batch_size: int = 4
    ds_config: str = "ds_configs/zero3_bf16.json"
    reference: bool = True  # the fp32 reference and the CPU check
    cpu_questions: int = 10
    work_dir: str = "out/bench-eval"


def _dtype(opts: EvalBenchOptions) -> torch.dtype:
    precision = opts.precision or ("bf16" if GPU else "fp32")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


# --- inputs --------------------------------------------------------------------------------------


def load_inputs(opts: EvalBenchOptions):
    tokenizer = load_tokenizer(opts.tokenizer or _shared() / "tokenizers" / "dolma2-tokenizer.json")
    paths = opts.tasks or [str(_shared() / "eval" / name) for name in ("arc_easy_rc_0shot", "piqa_rc_0shot")]
    tasks = [load_task(p) for p in paths]
    return tokenizer, paths, tasks, prepare_tasks(tokenizer, tasks, limit=opts.limit)


def task_summary(prepared) -> dict:
    return {"tasks": {e.task.name: len(e.questions) for e in prepared.entries}, "requests": len(prepared.requests),
            "request_tokens": sum(len(c) + len(k) for c, k in prepared.requests), "distinct_contexts": prepared.distinct_contexts}


def write_token_shards(directory: Path, tokenizer, num_tokens: int) -> Path:
    """Random-id shards labelled with `tokenizer`'s fingerprint (the trainer checks it against the tokenizer)."""
    if (directory / shards.MANIFEST).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, tokenizer.vocab_size, size=num_tokens)
    meta = shards.write_shard(directory, 0, tokens, np.array([0, num_tokens]), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
    shards.Manifest(num_tokens=num_tokens, num_docs=1, shards=[meta.bin], dtype=meta.dtype, vocab_size=tokenizer.vocab_size,
                    eos_id=tokenizer.eos_id, tokenizer_fingerprint=tokenizer.fingerprint,
                    extra={"generated_by": "olmo_ds.tools.bench_eval"}).save(directory)
    return directory


def twin(model, device, dtype=None, **cfg_changes):
    """A copy of `model` on `device` (in `dtype`), with config fields changed: built on the meta device and
    given the weights, so a 1B model costs no initialisation on the CPU."""
    with torch.device("meta"):
        out = OLMo(dataclasses.replace(model.cfg, **cfg_changes))
    out.load_state_dict({k: v.to(device=device, dtype=dtype or v.dtype) for k, v in model.state_dict().items()}, assign=True)
    return out.eval()


def build_models(opts: EvalBenchOptions, vocab_size: int):
    """(fp32 model, model in the run's precision with the same weights rounded), both on the device, eval mode."""
    torch.manual_seed(0)
    with torch.device(current_device()):
        fp32 = OLMo(preset(opts.preset, vocab_size=vocab_size)).eval()
    return fp32, twin(fp32, current_device(), _dtype(opts))


# --- measurements --------------------------------------------------------------------------------


def measure_tasks(model, tokenizer, prepared, max_len: int, batch_tokens: int, batching: str, repeats: int) -> dict:
    """One first call, then `repeats` timed calls (none for exact, which compiles nothing). Speeds are
    those of the fastest timed call (the first call's when there are none)."""
    def call():
        return evaluate_tasks(model, tokenizer, prepared, 0, 1, max_len=max_len, batch_tokens=batch_tokens, batching=batching)

    graphs0 = dynamo_graphs()
    first, first_s = timed(call)
    runs = [timed(call) for _ in range(repeats)]
    best, best_s = min(runs, key=lambda r: r[1]) if runs else (first, first_s)
    st = best.stats
    return {
        "batching": batching, "first_call_s": first_s, "steady_s": [s for _, s in runs], "seconds": best_s,
        "requests_per_s": st["requests"] / best_s, "request_tokens_per_s": st["request_tokens"] / best_s,
        "forward_tokens_per_s": st["forward_tokens"] / best_s, "forward_tokens": st["forward_tokens"],
        "padding_tokens": st["padding_tokens"], "forward_rows": st["forward_rows"],
        "dynamo_graphs_built": dynamo_graphs() - graphs0,
        "metrics": accuracies(best.tasks),
        "logprob": best.scored.logprob,  # per request; left out of the JSON
    }


def accuracies(tasks: dict) -> dict:
    return {name: {m: r[m] for m in ("acc", "acc_per_token", "acc_per_char", "acc_per_byte", "primary")} for name, r in tasks.items()}


def measure_perplexity(model, batches, token_bytes, batching: str, repeats: int) -> dict:
    def call():
        return evaluate_perplexity(model, batches, token_bytes, batching=batching)

    graphs0 = dynamo_graphs()
    first, first_s = timed(call)
    runs = [timed(call) for _ in range(repeats)]
    best, best_s = min(runs, key=lambda r: r[1]) if runs else (first, first_s)
    return {"batching": batching, "first_call_s": first_s, "steady_s": [s for _, s in runs], "seconds": best_s,
            "tokens": best.tokens, "tokens_per_s": best.tokens / best_s, "rows_per_s": best.rows / best_s,
            "forward_tokens_per_s": best.forward_tokens / best_s, "ce_loss": best.ce_loss,
            "dynamo_graphs_built": dynamo_graphs() - graphs0}


def build_train_config(opts: EvalBenchOptions, tokenizer, task_paths: list[str], work: Path):
    """The TrainConfig of a run with in-loop evaluation of the tasks (all questions, no unconditional requests)."""
    rows = opts.micro_batch_size * 4
    data = write_token_shards(work / f"shards-{opts.seq_len}", tokenizer, (rows + 4) * opts.seq_len)
    tree = {
        "run_dir": str(work / "run"),
        "max_steps": 1,
        "precision": opts.precision or ("bf16" if GPU else "fp32"),
        "deepspeed_config": opts.ds_config,
        # torch's AdamW instead of DeepSpeed's FusedAdam, whose JIT build (~30 s on a fresh GPU host) buys
        # nothing here: evaluation never steps the optimizer.
        "deepspeed_overrides": ["optimizer.params.torch_adam=true"],
        "tokenizer": str(tokenizer.path),
        "model": {"preset": opts.preset},
        "data": {"sources": [{"path": str(data)}]},
        "batch": {"global_batch_size": opts.micro_batch_size, "micro_batch_size": opts.micro_batch_size, "seq_len": opts.seq_len},
        "schedule": {"kind": "constant"},
        "checkpoint": {"every": 0, "save_final": False},
        "logging": {"tensorboard": False},
        "eval": {"every": 1, "tasks": task_paths, "task_limit": opts.limit or 0},
    }
    return config_from_dict(tree, source="bench_eval (in-loop)")


def measure_in_loop(opts: EvalBenchOptions, tokenizer, task_paths: list[str], work: Path) -> dict:
    """The trainer's own evaluator on its own engine, called `inloop_evals` times per batching."""
    cfg = build_train_config(opts, tokenizer, task_paths, work)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run each time: nothing to resume
    t0 = time.perf_counter()
    trainer = Trainer.from_config(cfg)
    out = {"init_s": time.perf_counter() - t0, "zero_stage": trainer.plan.deepspeed.zero.stage,
           "blocks_compiled": trainer.model_cfg.compiles_blocks(trainer.device.type),
           "batch_tokens": trainer.evaluator.batch_tokens, "max_len": trainer.evaluator.seq_len}
    try:
        for batching in ("packed", "exact") if opts.inloop_exact else ("packed",):
            trainer.evaluator.batching = batching
            calls = []
            for i in range(opts.inloop_evals if batching == "packed" else 1):
                graphs0 = dynamo_graphs()
                metrics, seconds = timed(lambda: trainer.evaluator(trainer.engine))
                calls.append({"seconds": seconds, "dynamo_graphs_built": dynamo_graphs() - graphs0,
                              **{k.removeprefix("eval/tasks/"): v for k, v in metrics.items() if k.startswith("eval/tasks/")}})
            steady = [c["seconds"] for c in calls[1:]]
            out[batching] = {"calls": calls, "first_call_s": calls[0]["seconds"],
                             "steady_s": min(steady) if steady else None,
                             "compile_s": calls[0]["seconds"] - min(steady) if steady else None,
                             "metrics": {k: v for k, v in metrics.items() if k.endswith(("/acc", "/acc_per_char", "/primary"))}}
        out["counters"] = block_counts()
    finally:
        trainer.loader.close()
        del trainer
        gc.collect()
        if GPU:
            torch.cuda.empty_cache()
    return out


def precision_report(low: np.ndarray, ref: np.ndarray, num_tokens: np.ndarray, low_metrics: dict, ref_metrics: dict) -> dict:
    diff = np.abs(low - ref)
    per_token = diff / num_tokens
    return {
        "max_abs": float(diff.max()), "p99_abs": float(np.percentile(diff, 99)), "mean_abs": float(diff.mean()),
        "max_abs_per_token": float(per_token.max()),
        "accuracy_delta_points": {task: {m: 100 * (low_metrics[task][m] - ref_metrics[task][m]) for m in ref_metrics[task]}
                                  for task in ref_metrics},
    }


def measure_precision(opts: EvalBenchOptions, fp32, low, tokenizer, tasks, prepared, max_len: int, packed_low: dict) -> dict:
    """Packed scores in the run's precision (`packed_low`, from `measure_tasks`) against fp32 (eager
    blocks, SDPA, no TF32) on the device over every request; and on the first `cpu_questions` questions
    of each task, both against fp32 on the CPU through the exact path."""
    pad = tokenizer.pad_id or 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = twin(fp32, current_device(), compile="eager", attention_backend="sdpa")
    num_tokens = np.array([len(k) for _, k in prepared.requests])
    result, seconds = timed(lambda: evaluate_tasks(ref, tokenizer, prepared, 0, 1, max_len=max_len, batch_tokens=opts.batch_tokens))
    out = {"device_fp32_s": seconds,
           "low_vs_fp32": precision_report(packed_low["logprob"], result.scored.logprob, num_tokens, packed_low["metrics"],
                                           accuracies(result.tasks))}
    if opts.cpu_questions:
        small = prepare_tasks(tokenizer, tasks, limit=opts.cpu_questions)
        t0 = time.perf_counter()
        cpu = twin(fp32, torch.device("cpu"), compile="eager")
        cpu_lp = score_requests(cpu, small.requests, max_len=max_len, batch_tokens=4096, pad_id=pad, batching="exact").logprob
        small_tokens = np.array([len(k) for _, k in small.requests])
        diffs = {}
        for name, m in (("fp32_device", ref), ("low_device", low)):
            lp = score_requests(m, small.requests, max_len=max_len, batch_tokens=opts.batch_tokens, pad_id=pad).logprob
            d = np.abs(lp - cpu_lp)
            diffs[name] = {"max_abs": float(d.max()), "max_abs_per_token": float((d / small_tokens).max())}
        out["vs_cpu_fp32"] = {"requests": len(small.requests), "seconds": time.perf_counter() - t0, **diffs}
        del cpu
    del ref
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()
    return out


# --- the run -------------------------------------------------------------------------------------


def run_bench(opts: EvalBenchOptions, json_path: Path | None = None) -> dict:
    """Every section in turn; with `json_path`, the result so far is written after each (a run cut short
    by a time limit leaves what it measured)."""
    setup_console_logging(0)
    normalize_cuda_arch_list()
    work = Path(opts.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tokenizer, task_paths, tasks, prepared = load_inputs(opts)
    result: dict = {"options": dataclasses.asdict(opts), "environment": environment(), "inputs": task_summary(prepared),
                    "precision": str(_dtype(opts)).replace("torch.", "")}

    def done(section: str) -> None:
        result["wall_s"] = time.perf_counter() - t_start
        print(f"bench_eval: {section} done at {result['wall_s']:.0f} s", flush=True)
        if json_path is not None:
            write_json(json_path, result)

    if opts.inloop:
        result["in_loop"] = measure_in_loop(opts, tokenizer, task_paths, work)
        done("in-loop")
    fp32, model = build_models(opts, tokenizer.vocab_size)
    max_len = model.cfg.max_seq_len
    result["model"] = {"preset": opts.preset, "params": model.cfg.num_params(), "max_seq_len": max_len}
    result["tasks"] = {b: measure_tasks(model, tokenizer, prepared, max_len, opts.batch_tokens, b, 0 if b == "exact" else opts.repeats)
                       for b in ("exact", "packed")}
    done("multiple choice")

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, tokenizer.vocab_size, size=opts.ppl_rows * opts.seq_len)
    batches = window_batches(tokens, opts.seq_len, max(1, opts.batch_tokens // opts.seq_len))
    table = token_byte_lengths(tokenizer)
    result["perplexity"] = {b: measure_perplexity(model, batches, table, b, 1 if b == "exact" else opts.repeats) for b in ("exact", "packed")}
    done("perplexity")

    if opts.reference:
        result["precision_check"] = measure_precision(opts, fp32, model, tokenizer, tasks, prepared, max_len, result["tasks"]["packed"])
        done("precision")
    result["counters"] = block_counts()
    done("all")
    return result


def write_json(path: Path, result: dict) -> None:
    """The result so far, without the per-request arrays."""
    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if not isinstance(v, np.ndarray)}
        return obj

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strip(result), indent=2, default=float))


def _ratio(a, b) -> str:
    return f"{a / b:.1f}x" if a and b else "-"


def format_report(r: dict) -> str:
    o, inp, env = r["options"], r["inputs"], r["environment"]
    tasks = " + ".join(f"{n} ({q:,} questions)" for n, q in inp["tasks"].items())
    lines = [
        f"bench_eval: {o['preset']} (random init), {r['precision']}, {env['device']}, torch {env['torch']}, deepspeed {env['deepspeed']}; "
        f"wall {r['wall_s']:.0f} s",
        f"multiple choice: {tasks}: {inp['requests']:,} requests, {inp['request_tokens']:,} request tokens; "
        f"batch_tokens {o['batch_tokens']:,}",
        f"{'multiple choice':<18} {'first s':>8} {'timed s':>8} {'requests/s':>11} {'request tok/s':>14} {'forward tok/s':>14} {'forward tok':>12} {'padding':>8}",
    ]
    for b, m in r["tasks"].items():
        lines.append(f"{b:<18} {m['first_call_s']:>8.2f} {m['seconds']:>8.2f} {m['requests_per_s']:>11,.0f} {m['request_tokens_per_s']:>14,.0f} "
                     f"{m['forward_tokens_per_s']:>14,.0f} {m['forward_tokens']:>12,} {m['padding_tokens'] / m['forward_tokens']:>7.1%}")
    p = r["perplexity"]
    lines.append(f"perplexity: {o['ppl_rows']} rows x {o['seq_len']} random ids ({p['exact']['tokens']:,} targets)")
    lines.append(f"{'perplexity':<18} {'first s':>8} {'timed s':>8} {'tokens/s':>11} {'forward tok/s':>14}")
    for b, m in p.items():
        lines.append(f"{b:<18} {m['first_call_s']:>8.2f} {m['seconds']:>8.2f} {m['tokens_per_s']:>11,.0f} {m['forward_tokens_per_s']:>14,.0f}")
    il = r.get("in_loop")
    if il:
        for b in ("packed", "exact"):
            if b not in il:
                continue
            m = il[b]
            last = m["calls"][-1]
            steady = f"{m['steady_s']:.2f} s per evaluation after the first" if m["steady_s"] is not None else "no second call"
            lines.append(f"in-loop {b} (Trainer's evaluator, ZeRO-{il['zero_stage']}, blocks {'compiled' if il['blocks_compiled'] else 'eager'}, "
                         f"batch_tokens {il['batch_tokens']:,}): first call {m['first_call_s']:.1f} s (compile included), {steady}; "
                         f"last call {last.get('request_tokens_per_s', float('nan')):,.0f} request tok/s, "
                         f"{last.get('forward_tokens_per_s', float('nan')):,.0f} forward tok/s")
    pc = r.get("precision_check")
    if pc:
        d = pc["low_vs_fp32"]
        acc = "; ".join(f"{t}: " + ", ".join(f"{k} {v:+.2f}" for k, v in ms.items()) for t, ms in d["accuracy_delta_points"].items())
        lines.append(f"{r['precision']} vs fp32 (device, all requests): |delta log-lik| max {d['max_abs']:.4f}, p99 {d['p99_abs']:.4f}, "
                     f"mean {d['mean_abs']:.5f} nats; max per continuation token {d['max_abs_per_token']:.4f}")
        lines.append(f"accuracy change, points: {acc}")
        c = pc.get("vs_cpu_fp32")
        if c:
            lines.append(f"vs fp32 on the CPU, exact path ({c['requests']} requests): device fp32 max |delta| {c['fp32_device']['max_abs']:.2e}, "
                         f"{r['precision']} max |delta| {c['low_device']['max_abs']:.4f} ({c['low_device']['max_abs_per_token']:.4f} per token)")
    t, pp = r["tasks"], r["perplexity"]
    lines.append(f"packed / exact: multiple choice {_ratio(t['packed']['request_tokens_per_s'], t['exact']['request_tokens_per_s'])}, "
                 f"perplexity {_ratio(pp['packed']['tokens_per_s'], pp['exact']['tokens_per_s'])}")
    lines.append(f"counters: {r.get('counters')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = EvalBenchOptions()
    p.add_argument("--preset", default="olmo2-1b" if GPU else "tiny", help="model preset, random init (default: olmo2-1b on GPU, tiny on CPU)")
    p.add_argument("--tasks", nargs="+", default=[], help="task dirs/files (default: $OLMO_DS_SHARED/eval/{arc_easy,piqa}_rc_0shot)")
    p.add_argument("--tokenizer", default=None, help="default: $OLMO_DS_SHARED/tokenizers/dolma2-tokenizer.json")
    p.add_argument("--limit", type=int, default=None if GPU else 20, help="questions per task (default: all on GPU, 20 on CPU)")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens if GPU else 4096, help="positions per forward, offline")
    p.add_argument("--seq-len", type=int, default=d.seq_len if GPU else 128, help="perplexity rows; the in-loop run's batch.seq_len")
    p.add_argument("--ppl-rows", type=int, default=d.ppl_rows if GPU else 8)
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls of the packed path after its first")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--no-inloop", dest="inloop", action="store_false", help="skip the in-loop (Trainer, DeepSpeed) measurement")
    p.add_argument("--inloop-evals", type=int, default=d.inloop_evals, help="evaluator calls (the first compiles)")
    p.add_argument("--inloop-exact", action="store_true", help="also one in-loop evaluation with batching exact (slow)")
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size if GPU else 1, help="the in-loop run's batch.micro_batch_size")
    p.add_argument("--ds-config", default=d.ds_config)
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the fp32 reference and the CPU check")
    p.add_argument("--cpu-questions", type=int, default=d.cpu_questions if GPU else 2,
                   help="questions per task scored in fp32 on the CPU too (0: none)")
    p.add_argument("--work-dir", default=d.work_dir)
    p.add_argument("--json", type=Path, default=None, help="also write the full result as JSON here")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    opts = EvalBenchOptions(
        preset=a.preset, tasks=a.tasks, tokenizer=a.tokenizer, limit=a.limit, batch_tokens=a.batch_tokens, seq_len=a.seq_len,
        ppl_rows=a.ppl_rows, repeats=a.repeats, precision=a.precision, inloop=a.inloop, inloop_evals=a.inloop_evals,
        inloop_exact=a.inloop_exact, micro_batch_size=a.micro_batch_size, ds_config=a.ds_config, reference=a.reference,
        cpu_questions=a.cpu_questions, work_dir=a.work_dir,
    )
    result = run_bench(opts, a.json)
    print(format_report(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
