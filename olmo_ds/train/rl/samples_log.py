"""The samples an RL step trained on, on disk: `RUN/samples/step-NNNNNNN.jsonl`, one JSON object a sample.

Users of every RL stack read their rollouts (TRL and open-instruct log tables of them); here they are files beside
the run's metrics, written by rank 0 with every rank's samples (a sequence group's once), in the order of the step's
global prompts (draw, then prompt, then sample), at steps 1-5 and then every `rl.samples_every` steps (0: never).
A line holds:

- `step`, `draw` (0; with active sampling 1, 2, ... for the step's extra draws of prompts), `prompt_index` (the
  prompt's global id in the training data: `DataLoader` numbers them), `sample` (its number in the group);
- `prompt` and `completion` (text: the prompt as the model read it, chat template included; the completion as the
  verifier read it), `verifier`, `score` (the verifier's), `reward` (what trained: the score, or
  `rl.truncated_reward` for a penalised truncated sample), `reason` (the verifier's failure or explanation, else null);
- `advantage`, `finish` (eos, stop or length), `length` (generated tokens), `logprob_mean` (the mean sampled
  log-probability of its tokens, as the decode engine drew them);
- `dropped` (null, or why its group trained nothing: "no signal" when every reward was equal, "surplus" when active
  sampling had filled the step already, "non-finite log-probabilities", "stale" when in-flight rollouts started it
  more than `rl.async_steps` versions before this step), `trained` (whether its tokens had a gradient: false for a
  dropped group and for a truncated sample with `rl.truncated: mask`), `update` (which of the step's
  `rl.updates_per_rollout` optimizer updates trained it, 0-based);
- `versions` ([first, last]: the policy versions, optimizer steps taken, its first and last token were drawn under;
  both `step` - 1 in a synchronous run, older with in-flight rollouts: `olmo_ds.train.rl.inflight`).

Files are written atomically (a reader never sees half of one) and never read by training. They rotate with the
checkpoints: once the run holds `checkpoint.keep_last` checkpoints, a file of a step before the oldest of them goes,
unless its step is a multiple of `checkpoint.keep_every`. A resumed run writes the steps after its checkpoint again
(the same samples: they are keyed by step). Read them with any JSON-lines reader, e.g.
`pandas.read_json("runs/x/samples/step-0000010.jsonl", lines=True)`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from olmo_ds import checkpoint as ckpt
from olmo_ds.atomic import atomic_write_bytes

ALWAYS_FIRST = 5  # steps 1..5 are written whatever samples_every says (unless it is 0)
_NAME = re.compile(r"^step-(\d+)\.jsonl$")


@dataclass(frozen=True)
class SamplesPlace:
    """Where a run's samples files go and how they rotate (its checkpoint settings)."""

    run_dir: Path
    keep_last: int
    keep_every: int = 0


def samples_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "samples"


def wanted(step: int, every: int) -> bool:
    """Whether step `step`'s samples are written (module docstring)."""
    return every > 0 and (step <= ALWAYS_FIRST or step % every == 0)


def write_samples(run_dir: Path, step: int, records: list[dict]) -> Path:
    """Write step `step`'s records (module docstring) atomically; returns the file."""
    path = samples_dir(run_dir) / f"step-{step:07d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    return path


def prune_samples(run_dir: Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Remove the sample files the checkpoints' rotation has passed (module docstring); returns them."""
    steps = [s for s, _ in ckpt.list_checkpoints(ckpt.checkpoints_dir(run_dir))]
    if len(steps) < keep_last:
        return []
    oldest = steps[-keep_last]
    removed = []
    for path in sorted(samples_dir(run_dir).glob("step-*.jsonl")):
        match = _NAME.match(path.name)
        if match and int(match.group(1)) < oldest and not (keep_every and int(match.group(1)) % keep_every == 0):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
