"""RL prompts scored by their verifiers: the greedy solve rate an RL run's in-loop evaluation logs, and, offline,
that number again or pass@k over samples (`eval.sh --data NAME=DIR` on shards of `prepare_data.py --format rl`).

One function, `evaluate_prompts`, serves both, so the two numbers cannot drift apart: the trainer's `RLEvaluator`
(olmo_ds/train/rl/grpo.py) hands it the policy gathered from ZeRO-3 and a validation source's prompts, `scripts/eval.py`
a checkpoint's weights and the same prompts. The answers are cut into waves of the batch size, dealt out to the
ranks (`evaluate_prompts`: a wave's sequences are decoded together whatever the number of ranks), generated
(`olmo_ds.model.decode.generate`, stopping at the EOS or the chat turn end: `stop_ids`) and scored by each prompt's
verifier (`olmo_ds.eval.scorer.score_all`: each under a time limit, as in an RL rollout); the ranks gather the scores, which are summed in the prompts' order:
every rank returns the same numbers, the same for any number of ranks. With the run's `rl.max_new_tokens` and
`rl.generation_batch_size` (eval.sh's defaults for a checkpoint of an RL run) and the same weights, offline and
in-loop evaluation decode the same tokens and report the same numbers.

Metrics (`RLResult.metrics`), overall and per verifier (`<metric>/<verifier>`):
- greedy (one answer a prompt, temperature 0; the in-loop evaluation): `solve_rate`, the share of prompts whose
  answer scores 1 (a fractional reward, IFEval's share of instructions followed, counts as solved only at 1, as
  the rollout's `rollout/solve_rate` counts it), and `reward_mean`, the mean reward;
- sampled (temperature > 0, K samples a prompt): `pass_at_k` for k = 1, 2, 4, ... below K and K itself (`pass_ks`),
  the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1) averaged
  over prompts: a prompt with c of its n samples solved scores 1 - C(n - c, k) / C(n, k) (`pass_at_k`); pass_at_1
  is the mean share of solved samples. `reward_mean` is over every sample. Sample j of prompt i draws from its own
  random stream keyed by (seed, i, j) (`sample_key`), not by where it is decoded, so the samples are the same on
  any number of ranks (`evaluate_prompts` on how the batches are formed).

`scripts/generate.py --prompts` scores RL prompt rows (`{"messages", "ground_truth", "dataset"}`) with the same
verifiers: `check_rows` refuses, before any weight is read, a row whose verifier is unknown or whose ground truth no
answer could match (`olmo_ds.eval.verifiers.check`, naming the row's file:line), and `score_answer` gives each answer
its reward and the verifier's reason.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmo_ds.data import shards
from olmo_ds.data.dataset import Prompt, TokenSource
from olmo_ds.eval.perplexity import parse_source_spec
from olmo_ds.eval.scoring import DistContext
from olmo_ds.eval.scorer import DEFAULT_TIMEOUT_S, score_all
from olmo_ds.eval.verifiers import check
from olmo_ds.model.decode import Request, Sampling, generate, stream_key


@dataclass(frozen=True)
class Decoding:
    """How each prompt is answered: `samples` answers of up to `max_new_tokens`, greedy at temperature 0 (then one),
    else sampled with `seed`; `batch_size` sequences decoded at once."""

    max_new_tokens: int
    batch_size: int
    samples: int = 1
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for key in ("max_new_tokens", "batch_size", "samples"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        Sampling(temperature=self.temperature, seed=self.seed)  # its own checks: temperature >= 0, seed in range
        if self.greedy and self.samples > 1:
            raise ValueError(f"{self.samples} samples a prompt need a temperature above 0: greedy decoding answers a "
                             "prompt the same way every time")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> dict:
        return {"samples": self.samples, "temperature": self.temperature, "seed": self.seed, "max_new_tokens": self.max_new_tokens,
                "batch_size": self.batch_size}


@dataclass
class RLResult:
    metrics: dict[str, float]  # see the module docstring
    records: list[dict]  # one per prompt, in the source's order: its answer(s), reward(s) and the verifier's reason
    stats: dict = field(default_factory=dict)  # this rank's generation: requests, new tokens, seconds


def stop_ids(tokenizer) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS and, where the vocabulary has it, the chat turn end (what the
    RL rollout stops at)."""
    ids = [tokenizer.eos_id]
    turn_end = tokenizer.token_to_id("<|im_end|>")
    if turn_end is not None:
        ids.append(turn_end)
    return list(dict.fromkeys(ids))


def sample_key(prompt_index: int, sample: int) -> int:
    """The random-stream key of sample `sample` of prompt `prompt_index` (within its source), in [0, 2**32)."""
    return stream_key(prompt_index, sample)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):
    1 - C(n - c, k) / C(n, k), exactly (integer binomials, one rounding)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """The k of the pass@k reported for `samples` samples a prompt: 1, 2, 4, ... below it, and it."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


def metrics(records: Sequence[dict], decoding: Decoding) -> dict[str, float]:
    """The metrics of the module docstring from per-prompt records (`evaluate_prompts`), summed in their order."""
    out = _metrics(records, decoding)
    for verifier in sorted({r["verifier"] for r in records}):
        out.update({f"{k}/{verifier}": v for k, v in _metrics([r for r in records if r["verifier"] == verifier], decoding).items()})
    return out


def _metrics(records: Sequence[dict], decoding: Decoding) -> dict[str, float]:
    n = max(len(records), 1)
    rewards = [x for r in records for x in r["rewards"]]
    out = {}
    if decoding.greedy:
        out["solve_rate"] = sum(r["solved"] for r in records) / n
    else:
        for k in pass_ks(decoding.samples):
            out[f"pass_at_{k}"] = sum(pass_at_k(decoding.samples, r["solved"], k) for r in records) / n
    out["reward_mean"] = sum(rewards) / max(len(rewards), 1)
    return out


def evaluate_prompts(model, prompts: Sequence[Prompt], *, tokenizer, decoding: Decoding, dist_ctx: DistContext,
                     stop: Sequence[int] | None = None, reward_fn: Callable[[str, str, Any], Any] | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S,
                     progress: Callable[[int, int, int], None] | None = None) -> RLResult:
    """Answer a source's `prompts` (the same list on every rank, in the source's order), score the answers and return
    the source's metrics on every rank (collective: every rank calls). `stop`: the ids that end an answer (default
    `stop_ids(tokenizer)`); by default each wave's answers are scored by their verifiers in `olmo_ds.eval.scorer`'s
    workers, each under `timeout_s` (a verifier that hangs scores 0 with its reason, as in an RL rollout); a
    `reward_fn(verifier, text, ground_truth)` (a `Reward` or a float) is called here instead.

    The answers (prompt-major: prompt 0's K samples, then prompt 1's ...) are cut into waves of `decoding.batch_size`
    and wave w is decoded by rank w mod world size, alone in one `generate` call. A sequence's neighbours in its batch
    therefore depend on the prompts and the batch size only, never on the number of ranks: where the decode engine's
    numbers move with a batch's composition (bf16 kernels on a GPU), a near tie would otherwise flip a token."""
    k = decoding.samples
    requests = [Request(list(p.ids), decoding.max_new_tokens, seed=None if decoding.greedy else sample_key(p.index, j))
                for p in prompts for j in range(k)]
    waves = [range(w, min(w + decoding.batch_size, len(requests))) for w in range(0, len(requests), decoding.batch_size)]
    mine = waves[dist_ctx.rank::dist_ctx.world]
    total = sum(len(w) for w in mine)
    answers, stats = [], {"requests": total, "new_tokens": 0, "seconds": 0.0}
    start = time.perf_counter()
    for wave in mine:
        done = generate(model, [requests[n] for n in wave], batch_size=len(wave), stop_ids=stop_ids(tokenizer) if stop is None else stop,
                        sampling=Sampling(temperature=decoding.temperature, seed=decoding.seed), tokenizer=tokenizer,
                        progress=_offset(progress, len(answers), stats["new_tokens"], total))
        stats["new_tokens"] += done.stats["new_tokens"]
        items = [(prompts[n // k].verifier, c.text or "", prompts[n // k].ground_truth) for n, c in zip(wave, done.completions)]
        scored = score_all(items, timeout_s=timeout_s) if reward_fn is None else [reward_fn(*item) for item in items]
        for n, c, r in zip(wave, done.completions, scored):
            score, reason = _score(r)
            answers.append((n, c.text or "", c.finish, len(c.tokens), score, reason))
    stats["seconds"] = time.perf_counter() - start
    by_request = {a[0]: a[1:] for part in dist_ctx.all_gather(answers) for a in part}
    records = []
    for i, p in enumerate(prompts):
        text, finish, new_tokens, rewards, reasons = zip(*(by_request[i * k + j] for j in range(k)))
        records.append({"index": p.index, "where": p.source, "verifier": p.verifier, "ground_truth": p.ground_truth,
                        "prompt_tokens": len(p.ids), "completions": list(text), "finish": list(finish), "new_tokens": list(new_tokens),
                        "rewards": list(rewards), "reasons": list(reasons), "solved": sum(r >= 1.0 for r in rewards)})
    return RLResult(metrics(records, decoding), records, stats)


def _offset(progress, done: int, tokens: int, total: int):
    """`progress` for one wave, counting the waves before it (`done` answers, `tokens` new tokens) and all of them (`total`)."""
    if progress is None:
        return None
    return lambda d, _, t: progress(done + d, total, tokens + t)


def _score(r) -> tuple[float, str | None]:
    """(score, the verifier's reason when it could not score) of a `Reward`, or of a plain float."""
    return (float(r), None) if isinstance(r, (int, float)) else (float(r.score), r.error or getattr(r, "detail", None))


def check_rows(rows: Sequence[tuple[str, Any, Any]]) -> list[str]:
    """The verifier names of RL prompt rows `(where, dataset, ground_truth)`; a ValueError `where: why` for the first
    row whose verifier is unknown or whose ground truth no answer could be scored against."""
    names = []
    for where, verifier, ground_truth in rows:
        try:
            names.append(check(verifier, ground_truth))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return names


def score_answer(verifier: str, text: str, ground_truth) -> dict:
    """An answer's `{"verifier", "reward", "reason"}`: its reward by `verifier` and, when the verifier could not score
    it, why (else None); the record `metrics` reads as one greedy answer (`rewards`, `solved`) is `answer_record`'s."""
    r = score_all([(verifier, text, ground_truth)])[0]
    return {"verifier": verifier, "reward": r.score, "reason": r.error or r.detail}


def answer_record(scored: dict) -> dict:
    """`score_answer`'s result as the per-prompt record `metrics` reads (one answer)."""
    return {"verifier": scored["verifier"], "rewards": [scored["reward"]], "solved": int(scored["reward"] >= 1.0)}


@dataclass
class RLSource:
    """An evaluation source of RL prompts (a shard directory whose manifest says `prompts: true`)."""

    name: str
    path: Path
    prompts: list[Prompt]  # every prompt, in the source's order
    verifiers: dict[str, int]  # prompts per verifier
    longest: int  # the longest prompt's tokens
    kind: str = "rl_prompts"


def is_rl_source(spec: str) -> bool:
    """Whether `--data [NAME=]PATH` names RL prompt shards (the directory or its `val/` split)."""
    path = _shard_dir(parse_source_spec(spec)[1])
    return path is not None and shards.Manifest.load(path).prompts


def _shard_dir(path: Path) -> Path | None:
    if path.is_dir() and not (path / shards.MANIFEST).exists() and (path / "val" / shards.MANIFEST).exists():
        path = path / "val"
    return path if path.is_dir() and (path / shards.MANIFEST).exists() else None


def load_rl_source(spec: str, tokenizer) -> RLSource:
    """An RL prompt source of `--data [NAME=]PATH`, checked against the model's tokenizer (its prompts' ids are that
    tokenizer's) and read through, before any weight is loaded. Named as other sources: NAME, else the directory's
    (its parent's for a `val/` split)."""
    name, path = parse_source_spec(spec)
    path = _shard_dir(path)
    source = TokenSource(path)
    if not tokenizer.matches(source.tokenizer_fingerprint):
        raise ValueError(f"{path / shards.MANIFEST}: the prompts were prepared with tokenizer {source.tokenizer_fingerprint}, but "
                         f"the model's tokenizer {tokenizer.path} is {tokenizer.fingerprint}: prepare them with the model's tokenizer")
    if source.max_token_id >= tokenizer.vocab_size:
        raise ValueError(f"{path}: token id {source.max_token_id} >= the tokenizer's vocab size {tokenizer.vocab_size}")
    prompts = [source.prompt(i) for i in range(source.num_prompts)]
    if not prompts:
        raise ValueError(f"{path}: holds no prompts")
    verifiers: dict[str, int] = {}
    for p in prompts:
        verifiers[p.verifier] = verifiers.get(p.verifier, 0) + 1
    return RLSource(name or (path.parent.name if path.name == "val" else path.name), path, prompts, dict(sorted(verifiers.items())),
                    max((len(p.ids) for p in prompts), default=0))
