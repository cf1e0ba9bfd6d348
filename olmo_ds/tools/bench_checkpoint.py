"""How long a checkpoint stops training, and how long it takes to complete, beside a raw write of the same bytes.

    python scripts/bench_checkpoint.py                      # GPU: olmo2-1b, ZeRO-3 bf16, seq 4096 (checkpoints of ~18 GB)
    python scripts/bench_checkpoint.py --preset tiny        # CPU smoke run

The real trainer (the same `Trainer` as `scripts/pretrain.py`, one rank, bench_train's generated data)
trains a few steps, then saves with `checkpoint.async_save: never` (blocking) and with `always`
(background), `--saves` times each, training on while the background save writes. Reported per save:
"blocked" (the time `save()` holds the training loop), "complete" (until `train_state.json` exists),
and the steps trained meanwhile; then a raw write of as many bytes as the checkpoint holds (one
buffer, `write` + `fsync`) into the same directory, the disk's own speed there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds.tools.bench_train import BenchOptions, build_train_config, write_bench_shards
from olmo_ds.train.config import ConfigError


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def raw_write(directory: Path, nbytes: int, chunk: int = 1 << 28) -> float:
    """Seconds to write and fsync `nbytes` into `directory` as one file (then removed)."""
    path = Path(directory) / "raw-write.bin"
    buf = memoryview(os.urandom(min(chunk, max(nbytes, 1))))
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(buf[: min(len(buf), left)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def run(opts: BenchOptions, saves: int = 2) -> dict:
    from olmo_ds.train.trainer import Trainer

    work = Path(opts.work_dir)
    shutil.rmtree(work / "run", ignore_errors=True)
    cfg = build_train_config(opts, Path(opts.work_dir) / "data", work)
    cfg.checkpoint.keep_last = 1
    write_bench_shards(opts, Path(opts.work_dir) / "data", cfg.model.build(None).vocab_size)
    trainer = Trainer(cfg)
    step = lambda: trainer.train_step(trainer.loader.next_batch())  # noqa: E731
    for _ in range(opts.warmup):
        step()
    rows = []
    for mode in ("never", "always"):
        cfg.checkpoint.async_save = mode
        for _ in range(saves):
            step()
            t0 = time.perf_counter()
            path = trainer.save()
            blocked = time.perf_counter() - t0
            trained = 0
            while trainer.saver.in_flight is not None:  # train on until the background save completes
                step()
                trained += 1
                trainer._saved(trainer.saver.poll())
            complete = time.perf_counter() - t0
            rows.append({"mode": "background" if mode == "always" else "blocking", "blocked_s": blocked, "complete_s": complete,
                         "steps_meanwhile": trained, "bytes": _dir_bytes(path)})
    nbytes = rows[-1]["bytes"]
    raw = raw_write(ckpt.checkpoints_dir(cfg.run_dir), nbytes)
    trainer.loader.close()
    return {"preset": opts.preset, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "saves": rows,
            "raw_write_s": raw, "raw_write_gb_s": nbytes / raw / 1e9}


def format_report(r: dict) -> str:
    lines = [f"checkpoint saves, {r['preset']} on {r['device']}",
             f"{'mode':<11} {'GB':>7} {'blocked s':>10} {'complete s':>11} {'steps meanwhile':>16} {'complete / raw':>15}"]
    for s in r["saves"]:
        lines.append(f"{s['mode']:<11} {s['bytes'] / 1e9:>7.2f} {s['blocked_s']:>10.2f} {s['complete_s']:>11.2f} "
                     f"{s['steps_meanwhile']:>16} {s['complete_s'] / r['raw_write_s']:>15.2f}")
    lines.append(f"raw write of the same bytes: {r['raw_write_s']:.2f} s ({r['raw_write_gb_s']:.2f} GB/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny")
    p.add_argument("--seq-len", type=int, default=4096 if gpu else 64)
    p.add_argument("--micro-batch-size", type=int, default=4 if gpu else 2)
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--saves", type=int, default=2, help="saves of each kind")
    p.add_argument("--work-dir", default="out/bench-checkpoint", help="generated data and the run's checkpoints (on the disk to measure)")
    p.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    opts = BenchOptions(preset=args.preset, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, warmup=args.warmup,
                        steps=4 * args.saves + 64, work_dir=args.work_dir)
    try:
        result = run(opts, args.saves)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
