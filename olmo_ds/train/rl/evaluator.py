"""In-loop evaluation of an RL run (`RLEvaluator`): the validation prompts answered greedily and scored by the
verifiers, through the function `eval.sh` runs on a checkpoint (`olmo_ds.eval.rl.evaluate_prompts`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from olmo_ds.data.dataset import Prompt
from olmo_ds.data.loader import validation_prompts
from olmo_ds.eval.rl import Decoding, evaluate_prompts
from olmo_ds.eval.scoring import DistContext
from olmo_ds.train.config import ConfigError
from olmo_ds.train.evaluation import val_sources
from olmo_ds.train.rl.rollout import gathered_policy


class RLEvaluator:
    """In-loop evaluation of an RL run: each validation source's prompts (`data.val_sources`, else each training
    source's val/ split) answered greedily by the current weights (gathered as for a rollout) and scored by the same
    verifiers, through `olmo_ds.eval.rl.evaluate_prompts` (what `eval.sh` runs on a checkpoint: the same numbers).
    Returns `eval/<source>/solve_rate` (the share of prompts whose answer scores 1) and `eval/<source>/reward_mean`,
    and each per verifier (`eval/<source>/solve_rate/<verifier>`). Every rank holds every prompt and answers its waves
    of them (the ranks of a sequence group different ones: the evaluation generates per rank, never spread over a
    group). Collective: every rank calls it."""

    def __init__(self, cfg, tokenizer, rank: int, world_size: int, reward_fn: Callable | None = None):
        self.tokenizer, self.reward_fn, self.dist = tokenizer, reward_fn, DistContext(rank, world_size)  # None: the scorer
        self.timeout_s = cfg.rl.verifier_timeout
        self.decoding = Decoding(max_new_tokens=cfg.rl.max_new_tokens, batch_size=cfg.rl.generation_batch_size)
        self.sets: list[tuple[str, list[Prompt]]] = []
        for src in val_sources(cfg):
            try:
                prompts = validation_prompts(src, 0, 1)  # all of them: `evaluate_prompts` deals them out
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{cfg.source}: eval: validation source {src.path}: {e}") from None
            self.sets.append((src.name or Path(src.path).name, prompts))

    def __call__(self, engine) -> dict[str, float]:
        module = engine.module if hasattr(engine, "module") else engine
        device = next(module.parameters()).device
        dtype = torch.bfloat16 if device.type == "cuda" else next(module.parameters()).dtype
        metrics = {}
        with gathered_policy(module, dtype) as policy:
            for name, prompts in self.sets:
                result = evaluate_prompts(policy, prompts, tokenizer=self.tokenizer, decoding=self.decoding,
                                          dist_ctx=self.dist, reward_fn=self.reward_fn, timeout_s=self.timeout_s)
                metrics.update({f"eval/{name}/{k}": v for k, v in result.metrics.items()})
        return metrics
