"""How many ranks each row needs: a train config's estimated peak memory per GPU for every sequence-parallel size
and activation-checkpointing choice, on the cards named, and the smallest size that fits.

    python scripts/memory_plan.py configs/olmo3-7b-stage3.yaml --gpus 64
    python scripts/memory_plan.py configs/olmo3-32b-stage1.yaml --gpus 64 --set batch.seq_len=65536 --set model.max_seq_len=65536

The figures are `olmo_ds.train.memory.estimate_peak_memory` at micro-batch 1 (the config's model, precision,
sequence length and its DeepSpeed JSON's ZeRO stage; ZeRO-3 partitions over all `--gpus` ranks), against the 80 %
of each card that `batch.micro_batch_size: auto` allows (`memory.MEMORY_FRACTION`). The estimate is calibrated on
one H200 without sequence parallelism (memory.py lists the points); what sequence parallelism adds
(`memory.sequence_parallel_bytes_per_token`) has not been measured on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from olmo_ds.model.sequence_parallel import sequence_parallel_problems
from olmo_ds.train.config import ConfigError, load_config
from olmo_ds.train.ds_config import ZeroLayout, read_ds_config, resolve_zero
from olmo_ds.train.memory import GiB, MEMORY_FRACTION, estimate_peak_memory

CARDS = {"H100 80GB": 79.2, "H200 141GB": 140.4}  # GiB torch reports for each
CHECKPOINTING = (False, "every_k:2", "full")
SIZES = (1, 2, 4, 8, 16, 32)


def plan(config: str, overrides: list[str], gpus: int, cards: dict[str, float]) -> tuple[str, list[str]]:
    """(the table as markdown, one line per card and checkpointing choice: the smallest size that fits)."""
    cfg = load_config(config, overrides)
    base = cfg.model.build()
    ds = read_ds_config(cfg)
    resolve_zero(ds, cfg, base, gpus, device="cuda")  # the "auto" ZeRO knobs as a GPU run resolves them
    zero = ZeroLayout.of(ds)
    seq_len = cfg.batch.seq_len
    sizes = [n for n in SIZES if gpus % n == 0 and not sequence_parallel_problems(
        n, n_heads=base.n_heads, n_kv_heads=base.n_kv_heads, seq_len=seq_len)]
    lines = [f"{cfg.source}: {cfg.model.preset} at {seq_len:,} tokens a row, micro-batch 1, {cfg.precision}, ZeRO-{zero.stage} "
             f"over {gpus} GPUs; GiB per GPU (budget {MEMORY_FRACTION:.0%} of the card)", "",
             "| activation checkpointing | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    peaks: dict = {}
    for mode in CHECKPOINTING:
        model = dataclasses.replace(base, activation_checkpointing=mode)
        peaks[mode] = [estimate_peak_memory(model, micro_batch=1, seq_len=seq_len, precision=cfg.precision, zero_stage=zero.stage,
                                            dp_world_size=gpus, reduce_bucket_size=zero.reduce_bucket_size,
                                            sequence_parallel=n).total / GiB for n in sizes]
        lines.append(f"| {_mode_name(mode)} | " + " | ".join(f"{p:.1f}" for p in peaks[mode]) + " |")
    verdicts = []
    for card, gib in cards.items():
        budget = MEMORY_FRACTION * gib
        for mode in CHECKPOINTING:
            fits = [n for n, p in zip(sizes, peaks[mode]) if p <= budget]
            verdicts.append(f"{card} (budget {budget:.1f} GiB), checkpointing {_mode_name(mode)}: "
                            + (f"sequence_parallel_size {fits[0]}" if fits else f"does not fit at any N up to {sizes[-1]}"))
    return "\n".join(lines), verdicts


def _mode_name(mode) -> str:
    return {False: "none", "full": "full"}.get(mode, str(mode))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/memory_plan.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a train config YAML")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the run (ZeRO-3 partitions over all of them; default 8)")
    p.add_argument("--gpu-gib", type=float, action="append", metavar="GIB",
                   help=f"a card's memory in GiB (repeatable; default: {', '.join(f'{k} {v}' for k, v in CARDS.items())})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    cards = {f"{g:g} GiB card": g for g in args.gpu_gib} if args.gpu_gib else CARDS
    try:
        table, verdicts = plan(args.config, args.overrides, args.gpus, cards)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table)
    print()
    print("\n".join(verdicts))
    return 0
