"""Why a run's loss or gradient norm is not finite: the likely causes, most likely first, for the error that stops it.

A non-finite step is skipped (DeepSpeed's overflow check discards its gradients) and never saved into a
checkpoint (`Trainer.save`); when the run stops on it, `nonfinite_report` says at which step and why it
probably happened. The order follows what can be ruled out: a config value outside its usual range first
(`suspicious_values`, e.g. a negative `model.rope_theta` or a huge `model.init_std`), because it is the
cheapest to fix and the most certain; then, when the loss was never finite, the data, since the loss of the
run's first step comes from the initial weights before any update and so cannot be the learning rate's
doing; the learning rate and warm-up last for such a run, first after the config for one that trained
finitely and then diverged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from olmo_ds.model.config import ModelConfig
from olmo_ds.train.config import TrainConfig


@dataclass(frozen=True)
class _Range:
    key: str  # the config key as a user writes it
    value: Callable[[TrainConfig, ModelConfig], float | None]
    ok: Callable[[float], bool]
    usual: str


# Ranges that published recipes (OLMo 2/3, Llama, GPT-NeoX) stay well inside; a value outside is not always
# wrong, but it is the first thing to look at when the loss is NaN.
_RANGES = (
    _Range("model.rope_theta", lambda c, m: m.rope_theta, lambda v: v > 0, "positive: 10,000 to 500,000"),
    _Range("model.init_std", lambda c, m: m.init_std, lambda v: 1e-4 <= v <= 0.2, "0.002 to 0.05"),
    _Range("model.norm_eps", lambda c, m: m.norm_eps, lambda v: 0 < v <= 1e-2, "1e-6 to 1e-5"),
    _Range("optim.lr", lambda c, m: c.optim.lr, lambda v: 0 < v <= 1e-2, "1e-4 to 6e-3 for pretraining"),
    _Range("optim.eps", lambda c, m: c.optim.eps, lambda v: 0 < v <= 1e-3, "1e-8"),
    _Range("optim.betas[0]", lambda c, m: c.optim.betas[0], lambda v: 0 <= v < 1, "0.9"),
    _Range("optim.betas[1]", lambda c, m: c.optim.betas[1], lambda v: 0 <= v < 1, "0.95 to 0.999"),
    _Range("optim.z_loss", lambda c, m: c.optim.z_loss, lambda v: 0 <= v <= 1e-2, "0 or 1e-5"),
    _Range("model.yarn.factor", lambda c, m: m.yarn.factor if m.yarn else None, lambda v: 1 <= v <= 64, "1 to 32"),
)


def suspicious_values(cfg: TrainConfig, model: ModelConfig) -> list[str]:
    """The run's config values outside their usual range (or not finite), each as `key = value (usual ...)`."""
    found = []
    for r in _RANGES:
        value = r.value(cfg, model)
        if value is None:
            continue
        if not math.isfinite(value) or not r.ok(value):
            found.append(f"{r.key} = {value:g} (usual: {r.usual})")
    return found


def nonfinite_report(cfg: TrainConfig, model: ModelConfig, *, step: int, loss: float, grad_norm: float | None,
                     in_a_row: int, last_finite_step: int | None, newest_checkpoint: str | None, why_stopped: str) -> str:
    """The error that stops a run at a non-finite `step`: what was not finite, since when, what was (not) saved,
    and the likely causes in order. `last_finite_step`: the last step of this process whose loss and gradient
    norm were finite, or the resumed checkpoint's step; None when the run never had one (then `step` - `in_a_row`
    is 0: the first step's loss already was not finite)."""
    what = f"loss {loss:g}, gradient norm {'-' if grad_norm is None else f'{grad_norm:g}'}"
    since = ("every step of this run since its first" if last_finite_step is None
             else f"{in_a_row} step{'s' if in_a_row != 1 else ''} since step {last_finite_step}, the last finite one")
    saved = (f"the newest checkpoint, {newest_checkpoint}, is from a finite step" if newest_checkpoint
             else "no checkpoint was saved")
    causes = []
    odd = suspicious_values(cfg, model)
    if odd:
        causes.append(f"config values outside their usual range in {cfg.source}: {'; '.join(odd)}")
    data = ("the data: a batch whose ids or documents the model cannot take; check the shards with "
            "`python scripts/validate_shards.py DIR` and the model's vocab_size against the tokenizer")
    lr = (f"the learning rate: optim.lr {cfg.optim.lr:g} reached after schedule.warmup_steps {cfg.schedule.warmup_steps} "
          f"with optim.grad_clip {cfg.optim.grad_clip:g}; lower optim.lr, raise schedule.warmup_steps or clip gradients")
    precision = ["precision fp16, which overflows where bf16 does not"] if cfg.precision == "fp16" else []
    if last_finite_step is None:
        # Step 1's loss and gradients come from the initial weights: no update, so no learning rate, has acted yet.
        model_numbers = (f"the weights init_from starts from ({cfg.init_from.path})" if cfg.init_from.path
                         else f"the model section of {cfg.source} (model.rope_theta, model.init_std, model.norm_eps, ...)")
        model_named = any(o.startswith("model.") for o in odd)
        causes += [*([] if model_named and not cfg.init_from.path else [model_numbers]), data, *precision]
        ruled_out = " The learning rate is not a cause: step 1's loss and gradients come from the initial weights, before any update."
    else:
        causes += [lr, data, *precision]
        ruled_out = ""
    numbered = " ".join(f"({i}) {c}." for i, c in enumerate(causes, 1))
    return (f"step {step}: the loss or gradient norm is not finite ({what}) at {since}; {why_stopped}. Nothing non-finite is "
            f"saved: {saved}. Likely causes, most likely first: {numbered}{ruled_out} Fix the cause, then "
            + ("resume with --resume auto" if newest_checkpoint else "start again (--start-over moves this run's logs aside)"))
