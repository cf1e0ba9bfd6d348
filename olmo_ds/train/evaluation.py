"""In-loop evaluation: validation loss / perplexity / bits-per-byte and downstream tasks during training.

Everything is read, tokenized and checked when the trainer starts (a missing validation split or a
misspelt task name fails before step one), and the same fixed batches are scored at every
evaluation so the curve compares like with like. Each rank scores its own share of the validation
rows and the evaluators gather the sums (olmo_ds/eval/), so the numbers do not depend on the world
size and every ZeRO-3 forward is matched on every rank.
"""

from __future__ import annotations

import math
from itertools import islice
from pathlib import Path

import numpy as np

from olmo_ds.data.config import SourceConfig
from olmo_ds.data.loader import validation_batches
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.perplexity import evaluate_perplexity, token_byte_lengths
from olmo_ds.eval.preference import evaluate_preference
from olmo_ds.eval.tasks import load_task, resolve_task
from olmo_ds.train.config import ConfigError, TrainConfig

def val_sources(cfg: TrainConfig) -> list[SourceConfig]:
    """`data.val_sources`, else each training source's `val/` split where prepare_data wrote one."""
    if cfg.data.val_sources:
        return cfg.data.val_sources
    return [SourceConfig(path=str(Path(s.path) / "val"), name=f"{s.name or Path(s.path).name}") for s in cfg.data.sources
            if (Path(s.path) / "val" / "manifest.json").is_file()]


class InLoopEvaluator:
    """Called every `eval.every` steps with the engine; returns flat metrics like `eval/<source>/ppl`."""

    def __init__(self, cfg: TrainConfig, tokenizer, vocab_size: int, rank: int, world_size: int):
        e = cfg.eval
        self.seq_len = cfg.batch.seq_len
        self.batching = e.batching
        # Tasks' tokens per forward: a micro-batch's worth (the activations training already holds), 16K at least.
        self.batch_tokens = max(16384, cfg.batch.micro_batch_size * cfg.batch.seq_len)
        self.tokenizer = tokenizer
        # Without a tokenizer there are no byte lengths: bits-per-byte is then not reported.
        self.token_bytes = token_byte_lengths(tokenizer) if tokenizer is not None else np.zeros(vocab_size, dtype=np.int64)
        self.val: list[tuple[str, list[dict]]] = []
        # Preference pairs (a `dpo:` run): the preference metrics, against the reference the trainer hands over.
        self.preference: tuple[object, dict] | None = None
        for src in val_sources(cfg):
            name = src.name or Path(src.path).name
            try:
                stream = validation_batches(src, self.seq_len, cfg.batch.micro_batch_size, rank, world_size,
                                            long_docs=cfg.data.long_conversations, long_pairs=cfg.data.long_pairs)
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"{cfg.source}: eval: validation source {src.path}: {err}") from None
            # Every rank gets the same number of batches from validation_batches; a prefix keeps that.
            self.val.append((name, list(islice(stream, e.max_batches))))
        self.tasks = None
        if e.tasks:
            if tokenizer is None:
                raise ConfigError(f"{cfg.source}: eval.tasks needs `tokenizer` set (tasks are text)")
            try:
                loaded = [load_task(resolve_task(t, [Path(d) for d in e.task_dirs])) for t in e.tasks]
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"{cfg.source}: eval.tasks: {err}") from None
            self.tasks = prepare_tasks(tokenizer, loaded, limit=e.task_limit or None)
        if not self.val and not self.tasks:
            raise ConfigError(
                f"{cfg.source}: eval.every is {e.every} but there is nothing to evaluate: no data source has a "
                f"validation split (SOURCE/val/, which `prepare_data.py --val-fraction 0.01` writes), data.val_sources "
                f"is empty and eval.tasks is empty. Prepare the data with --val-fraction, set data.val_sources or "
                f"eval.tasks, or turn in-loop evaluation off with --set eval.every=0"
            )

    def __call__(self, engine) -> dict[str, float]:
        """Metrics, and how fast they came: `eval/<source>/{tokens_per_s,forward_tokens_per_s}` per
        validation source, `eval/tasks/{requests_per_s,request_tokens_per_s,forward_tokens_per_s,seconds}`."""
        metrics: dict[str, float] = {}
        for name, batches in self.val:
            if self.preference is not None:
                metrics.update(self._preference_metrics(engine, name, batches))
                continue
            r = evaluate_perplexity(engine, batches, self.token_bytes, split=False, batching=self.batching)
            metrics[f"eval/{name}/loss"] = r.ce_loss
            metrics[f"eval/{name}/ppl"] = r.perplexity
            if math.isfinite(r.bits_per_byte):
                metrics[f"eval/{name}/bpb"] = r.bits_per_byte
            metrics[f"eval/{name}/tokens_per_s"] = r.tokens_per_second
            metrics[f"eval/{name}/forward_tokens_per_s"] = r.forward_tokens_per_second
        if self.tasks is not None:
            result = evaluate_tasks(engine, self.tokenizer, self.tasks, max_len=self.seq_len, batch_tokens=self.batch_tokens,
                                    batching=self.batching)
            for task, values in result.tasks.items():
                for key, value in values.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        metrics[f"eval/{task}/{key}"] = float(value)
            st = result.stats
            metrics["eval/tasks/requests_per_s"] = st["requests_per_second"]
            metrics["eval/tasks/request_tokens_per_s"] = st["request_tokens_per_second"]
            metrics["eval/tasks/forward_tokens_per_s"] = st["forward_tokens_per_second"]
            metrics["eval/tasks/seconds"] = st["score_seconds"]
        return metrics

    def use_reference(self, cache, settings: dict) -> None:
        """Score the validation pairs with the preference metrics (`olmo_ds.eval.preference`): `cache` is the run's
        `ReferenceCache` (None for simpo), `settings` the loss's (kind, beta, label smoothing, simpo gamma)."""
        self.preference = (cache, settings)

    def _preference_metrics(self, engine, name: str, batches: list[dict]) -> dict[str, float]:
        cache, settings = self.preference
        reference = None
        if cache is not None:
            if name not in cache.val:
                raise ConfigError(f"eval: validation source {name!r} has no reference in the run's cache (it has: "
                                  f"{', '.join(cache.val) or 'none'}); the validation sources changed since the reference pass")
            reference = cache.val[name].lookup
        r = evaluate_preference(engine, batches, reference, device=getattr(engine, "device", None), **settings)
        return {f"eval/{name}/{k}": v for k, v in r.items()}
