"""Training throughput, MFU, memory and data wait of the real pretrain step on one device,
against a plain-PyTorch step of the same model and batches (see olmo_ds/train/bench.py).

    python scripts/bench_train.py                                    # GPU: olmo2-1b, seq 4096, micro-batch 4, ZeRO-3
    python scripts/bench_train.py --preset tiny --seq-len 64 --micro-batch-size 2 --steps 3   # CPU smoke run
    python scripts/bench_train.py --ds-set zero_optimization.reduce_bucket_size=500000000
    python scripts/bench_train.py --sweep baseline,eager,baseline+accum8   # one process per variant, table last

Runs as a single rank without a launcher (or under `deepspeed --num_gpus 1`). On a machine without a
GPU it defaults to the tiny preset in fp32 so that it finishes in seconds.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from olmo_ds.train.bench import VARIANTS, BenchOptions, Experiments, format_report, format_sweep, run_bench, run_sweep
from olmo_ds.train.config import ConfigError


def main() -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny", help="model preset (default: olmo2-1b on GPU, tiny on CPU)")
    p.add_argument("--seq-len", type=int, default=4096 if gpu else 128)
    p.add_argument("--micro-batch-size", type=int, default=4 if gpu else 2)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--ds-config", default="ds_configs/zero3_bf16.json")
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DeepSpeed JSON field, e.g. zero_optimization.reduce_bucket_size=500000000")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. compile=eager (no compiled blocks) or attention_backend=sdpa_flash")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--steps", type=int, default=20 if gpu else 3)
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the plain-PyTorch step")
    p.add_argument("--reference-fp32-master", action="store_true",
                   help="also time a plain-PyTorch step with DeepSpeed's precision recipe: fp32 master weights and AdamW moments")
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false", help="only the plain-PyTorch step")
    p.add_argument("--work-dir", default=BenchOptions.work_dir, help="generated shards (reused) and the resolved DeepSpeed JSON")
    g = p.add_argument_group("experiment switches (patch this process only; see olmo_ds.train.bench.Experiments)")
    g.add_argument("--compile-pointwise", action="store_true", help="torch.compile RMSNorm, RoPE and SwiGLU math")
    g.add_argument("--loss-chunk", type=int, default=None, help="tokens per chunk of the fused head + loss")
    g.add_argument("--deepcompile", action="store_true", help="DeepSpeed DeepCompile (engine.compile with deepcompile on)")
    g.add_argument("--engine-compile", action="store_true", help="engine.compile(): torch.compile under DeepSpeed's hooks")
    g.add_argument("--compile-backend", default="inductor", help="for --compile-pointwise and engine.compile()")
    p.add_argument("--profile-dir", default=None, help="profile two extra steps of each path; op tables and Chrome traces (trace_<path>.json.gz) go here")
    p.add_argument("--json", type=Path, default=None, help="also write the full result as JSON here")
    p.add_argument("--sweep", default=None, metavar="V1,V2,...",
                   help=f"run named variants, one process each, and print a table; known: {', '.join(VARIANTS)}")
    p.add_argument("--sweep-timeout", type=float, default=None, help="seconds per variant before it is killed")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args()

    try:
        if args.sweep:
            # Everything after the script name except --sweep/--json is passed on to each variant.
            base, skip = [], False
            for a in sys.argv[1:]:
                if skip:
                    skip = False
                elif a in ("--sweep", "--json", "--sweep-timeout"):
                    skip = True
                elif not a.startswith(("--sweep=", "--json=", "--sweep-timeout=")):
                    base.append(a)
            out_dir = Path(args.work_dir) / "sweep"
            rows = run_sweep(args.sweep.split(","), base, out_dir, args.sweep_timeout)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
            print(format_sweep(rows))
            return 0 if all(r.get("result") for r in rows) else 1
        opts = BenchOptions(
            preset=args.preset, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
            ds_config=args.ds_config, ds_set=args.ds_set, model_set=args.model_set, precision=args.precision,
            warmup=args.warmup, steps=args.steps, reference=args.reference, reference_fp32_master=args.reference_fp32_master, deepspeed=args.deepspeed, work_dir=args.work_dir,
            profile_dir=args.profile_dir,
            experiments=Experiments(compile_pointwise=args.compile_pointwise, loss_chunk=args.loss_chunk, deepcompile=args.deepcompile,
                                    engine_compile=args.engine_compile, compile_backend=args.compile_backend),
        )
        result = run_bench(opts)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
