"""The rollout phase of RL with verifiable rewards: this rank's prompts -> scored samples -> packed training rows.

    with gathered_policy(engine.module, dtype) as policy:          # whole weights, once per rollout
        samples = sample_groups(policy, prompts, rl, step=step, stop_ids=..., tokenizer=tok)
    score_samples(samples, prompts, reward_fn)
    groups = group_advantages(samples, prompts, normalize_std=rl.normalize_advantage_std)
    rows = pack_rows(groups.kept, prompts, seq_len, rows=...)

Generation needs whole weights, which ZeRO-3 keeps partitioned over the ranks. `gathered_policy` gathers them once
per rollout, one module's parameters at a time (`deepspeed.zero.GatheredParameters`), into a plain `OLMo` in the
decode dtype (bf16 on a GPU, the training dtype on CPU), and frees it when the rollout ends: the peak is the copy
(2 bytes a parameter) plus one gathered module. In-flight rollouts (`rl.async_steps`, `olmo_ds.train.rl.inflight`)
keep the copy instead and gather each step's weights into it in place (`gather_into`). Each rank then generates for its own prompts with the project's
decode engine (`olmo_ds.model.decode.generate`), G samples each (`rl.samples_per_prompt`), so a prompt's group
stays on its rank and its statistics need no communication.

With sequence parallelism the N ranks of a sequence group hold the same prompts (the data-parallel rank's) and
train on the same rows, 1/N of each. They split the generation instead of repeating it: rank r draws and scores
its contiguous share of the group's prompt-major (prompt, sample) pairs (`group_share`), and the group all-gathers
the scored samples (`gather_samples`), so that every rank of it computes the same advantages and packs the same
rows.

Sampling is seeded per sample: `sample_key(seed, step, prompt_index, j)` keys sample j of the global prompt
`prompt_index` at optimizer step `step` (`Request.seed`), so a resumed run or another rank layout draws the same
tokens.

Advantages follow open-instruct's OlmoRL (commit e6c3044, open_instruct/data_loader.py l.1472-1484): a sample's
reward minus its group's mean ("centered"), divided by the group's std + 1e-8 when `rl.normalize_advantage_std`
("standard"). A group whose rewards are all equal has advantage 0 everywhere, so it carries no gradient; it is
dropped before packing and counted (`Groups.dropped`), as open-instruct's zero-std filtering does; so is a group
with a non-finite sampled log-probability (`Groups.nonfinite`: it would make the step's loss NaN).

Rows: samples (prompt + completion, the completion's EOS or stop id included) packed first-fit into rows of
`seq_len` tokens, each a document of its own (`doc_lens`, `positions` restart at 0: attention never crosses
samples, as packed fine-tuning rows). Per position t, whose label is token t + 1: `labels` (-100 unless t + 1 is a
generated token), `sampled` (the decode engine's log-probability of that token), `advantages`. Every rank gets
the same number of rows, a multiple of the micro-batch (empty rows: all labels -100), so that the ranks run the
same number of forwards and backwards under ZeRO-3.

Several optimizer updates per rollout (`rl.updates_per_rollout` K): update k trains the groups of this rank's
prompts k, k + K, k + 2K, ... (`update_of`), packed into a block of rows of its own, and the K blocks are laid out
one after the other, each as many rows as the fullest update needs over all ranks. A group never spans two updates,
each update gets the same number of prompts (+-1), and when every rank's prompts are a multiple of K an update holds
the same prompts however many ranks share the step (rank r's prompt j is the global batch's prompt r x B + j).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from olmo_ds.data.dataset import Prompt
from olmo_ds.eval.scorer import DEFAULT_TIMEOUT_S, score_all
from olmo_ds.model import OLMo
from olmo_ds.model.decode import Request, Sampling, generate, stream_key
from olmo_ds.model.loss import IGNORE_INDEX


@dataclass
class Sample:
    prompt: int  # position of its prompt in the rank's list
    tokens: list[int]
    logprobs: list[float]
    finish: str
    text: str
    index: int = 0  # its number in its prompt's group (0 .. G - 1)
    reward: float = 0.0  # what it trains with: the verifier's score, or `rl.truncated_reward` when penalised
    score: float = 0.0  # the verifier's score
    error: str | None = None  # why the verifier scored 0 (a failure: timeout, crash, bad output), else None
    detail: str | None = None  # the verifier's reason for its score, where it gives one
    advantage: float = 0.0
    dropped: str | None = None  # why its group trains nothing: "no signal" (equal rewards), "surplus" (active sampling),
    # "non-finite log-probabilities", "stale" (in-flight rollouts: started more than rl.async_steps versions ago)
    trained: bool = True  # False: a truncated sample with rl.truncated mask (counted in its group, never trained)
    versions: tuple[int, int] | None = None  # the policy versions (steps) of its first and last token (in-flight rollouts)


@dataclass
class Groups:
    """The scored samples that train (groups with a reward spread), and what the rollout counted."""

    kept: list[Sample]
    all: list[Sample]
    dropped: int  # groups that train nothing: their rewards were all equal (or see `Sample.dropped`)
    groups: int
    reward_errors: int = 0
    by_verifier: dict[str, list[float]] = field(default_factory=dict)
    nonfinite: int = 0  # of the dropped groups, those with a non-finite sampled log-probability


def sample_key(seed: int, step: int, prompt_index: int, sample: int) -> int:
    """The random-stream key of sample `sample` of global prompt `prompt_index` at step `step`, in [0, 2**32)."""
    return stream_key(seed, step, prompt_index, sample)


def empty_policy(module: OLMo, dtype: torch.dtype) -> OLMo:
    """A plain `OLMo` of `module`'s shape in `dtype` on its device, in eval mode, its weights not yet set
    (`gather_into` fills them)."""
    with torch.device("meta"):
        policy = OLMo(module.cfg)
    return policy.to_empty(device=next(module.parameters()).device).to(dtype).eval()


@torch.no_grad()
def gather_into(policy: OLMo | None, module: OLMo, dtype: torch.dtype, timings: dict | None = None) -> None:
    """Copy `module`'s whole weights into `policy`'s, in place (so a decode engine holding `policy`, its CUDA graphs
    too, runs the new weights). Under ZeRO-3 each parameter is gathered (collective: every rank calls this together),
    one module at a time, copied, and released; without partitioned parameters it is a plain copy. `policy` None:
    this rank only takes part in the gathering. `timings["gather"]`: seconds taken, added."""
    import deepspeed

    t0 = time.perf_counter()
    targets = dict(policy.named_parameters()) if policy is not None else {}
    for name, sub in module.named_modules():
        params = [(f"{name}.{n}" if name else n, p) for n, p in sub.named_parameters(recurse=False)]
        if not params:
            continue
        partitioned = [p for _, p in params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None, enabled=bool(partitioned)):
            for full, p in params:
                if full in targets:
                    targets[full].copy_(p.data.to(dtype))
    if timings is not None:
        timings["gather"] = timings.get("gather", 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def gathered_policy(module: OLMo, dtype: torch.dtype, timings: dict | None = None, keep: bool = True):
    """A plain `OLMo` holding `module`'s whole weights in `dtype` on its device, for generation; freed on exit
    (`gather_into`). `timings["gather"]`: seconds taken. `keep` False: this rank only takes part in the gathering and
    gets None (with actor ranks, learners other than the first hold no decode copy)."""
    t0 = time.perf_counter()
    device = next(module.parameters()).device
    policy = empty_policy(module, dtype) if keep else None
    gather_into(policy, module, dtype)
    if timings is not None:
        timings["gather"] = timings.get("gather", 0.0) + time.perf_counter() - t0
    try:
        yield policy
    finally:
        del policy
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sample_groups(policy: OLMo, prompts: Sequence[Prompt], *, samples_per_prompt: int, max_new_tokens: int,
                  temperature: float, seed: int, step: int, stop_ids: Sequence[int], tokenizer,
                  batch_size: int, pairs: range | None = None, top_p: float = 1.0, stop: Sequence[str] = (),
                  first: int = 0, should_stop: Callable[[], bool] | None = None, lengths: Callable | None = None,
                  stats: dict | None = None) -> list[Sample]:
    """G samples of prompts `first`, `first` + 1, ... (prompt-major: that prompt's G samples, then the next one's ...),
    or only the (prompt, sample) pairs `pairs` of that order (a rank's share of its sequence group's, `group_share`):
    pair k is sample k % G of prompt `first` + k // G, keyed as it would be wherever it is drawn. `stop`: strings that
    end a sample; `should_stop`: checked between the decode engine's forwards (`generate`'s `interrupt`). `lengths`
    (benchmarks only, `sample_requests`): each sample's own limit. `stats`: the decode steps' rows and slots are added
    to its "decode_rows" and "slot_steps" (the decode occupancy)."""
    g = samples_per_prompt
    pairs = range((len(prompts) - first) * g) if pairs is None else pairs
    at = lambda k: prompts[first + k // g]  # noqa: E731
    requests = sample_requests([(at(k), k % g) for k in pairs], step=step, seed=seed, max_new_tokens=max_new_tokens, stop=stop,
                               lengths=lengths)
    if not requests:
        return []
    done = generate(policy, requests, batch_size=batch_size, sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed),
                    stop_ids=stop_ids, tokenizer=tokenizer, interrupt=should_stop)
    if stats is not None:
        stats["decode_rows"] = stats.get("decode_rows", 0) + done.stats["decode_rows"]
        stats["slot_steps"] = stats.get("slot_steps", 0) + done.stats["decode_forwards"] * done.stats["batch_size"]
    return [Sample(prompt=first + k // g, index=k % g, tokens=list(c.tokens), logprobs=[float(x) for x in c.logprobs],
                   finish=c.finish, text=c.text or "") for k, c in zip(pairs, done.completions)]


def sample_requests(pairs: Sequence[tuple[Prompt, int]], *, step: int, seed: int, max_new_tokens: int, stop: Sequence[str] = (),
                    lengths: Callable[[int, int, int], int] | None = None) -> list[Request]:
    """The decode requests of (prompt, sample number) `pairs` at step `step`, each keyed by `sample_key`. `lengths(step,
    prompt_index, sample)` -> that sample's max_new_tokens, for benchmarks whose random model never ends a sample
    itself (olmo_ds/tools/bench_rl.py `--lengths realistic`); None: `max_new_tokens` for every one."""
    return [Request(list(p.ids), lengths(step, p.index, j) if lengths is not None else max_new_tokens, stop=tuple(stop),
                    seed=sample_key(seed, step, p.index, j)) for p, j in pairs]


def group_share(pairs: int, size: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of a sequence group's `pairs` (prompt, sample) pairs over its `size` ranks: as
    even as can be (the first pairs % size ranks one more), in order, so the shares joined are the whole list."""
    return range(rank * pairs // size, (rank + 1) * pairs // size)


def gather_samples(samples: list[Sample], group) -> list[Sample]:
    """Every rank's `samples` of the process group `group`, joined in rank order (collective over the group)."""
    parts: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, samples, group=group)
    return [s for part in parts for s in part]


def score_samples(samples: list[Sample], prompts: Sequence[Prompt], reward_fn: Callable[[str, str, Any], Any] | None = None,
                  *, timeout_s: float = DEFAULT_TIMEOUT_S, truncated: str = "keep", truncated_reward: float = 0.0) -> None:
    """Each sample's score from its prompt's verifier (and the verifier's error and reason, if any), then its reward.

    By default the verifiers run in `olmo_ds.eval.scorer`'s worker processes, each sample under `timeout_s` seconds:
    a verifier that hangs, crashes or runs out of memory scores 0 with its reason, and the step goes on. A
    `reward_fn(verifier, text, ground_truth)` (-> an object with `score` and `error`, or a float) is called here
    instead. `truncated` (`rl.truncated`) for samples cut at max_new_tokens (finish "length"), as open-instruct's
    data_loader.py (e6c3044) l.1187-1202 `maybe_mask_truncated_completions` and ground_truth_utils.py l.1410-1414
    `non_stop_penalty`: "keep" trains them as scored; "mask" keeps them in their group's mean and std but trains
    none of their tokens; "penalty" replaces their reward with `truncated_reward`."""
    if reward_fn is None:
        items = [(prompts[s.prompt].verifier, s.text, prompts[s.prompt].ground_truth) for s in samples]
        results = score_all(items, timeout_s=timeout_s) if items else []
    else:
        results = [reward_fn(prompts[s.prompt].verifier, s.text, prompts[s.prompt].ground_truth) for s in samples]
    for s, r in zip(samples, results):
        if isinstance(r, (int, float)):
            s.score, s.error, s.detail = float(r), None, None
        else:
            s.score, s.error, s.detail = float(r.score), r.error, getattr(r, "detail", None)
        s.reward = s.score
        if s.finish == "length" and truncated == "penalty":
            s.reward = truncated_reward
        s.trained = not (s.finish == "length" and truncated == "mask")


def group_advantages(samples: list[Sample], prompts: Sequence[Prompt], *, samples_per_prompt: int, normalize_std: bool) -> Groups:
    """The scored samples' (`score_samples`) advantages per group, and the groups with a reward spread kept (module
    docstring)."""
    by_verifier: dict[str, list[float]] = {}
    for s in samples:
        by_verifier.setdefault(prompts[s.prompt].verifier, []).append(s.reward)
    kept, dropped, nonfinite = [], 0, 0
    for g in range(0, len(samples), samples_per_prompt):
        group = samples[g:g + samples_per_prompt]
        if group[0].dropped == "stale":  # in-flight rollouts: too old to train (`olmo_ds.train.rl.inflight`)
            dropped += 1
            continue
        rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
        mean, std = rewards.mean(), rewards.std(unbiased=False)
        # a non-finite sampled log-probability (a decode gone wrong) would make the importance weight and loss NaN
        bad = not all(math.isfinite(x) for s in group for x in s.logprobs)
        if bad or bool((rewards == rewards[0]).all()):
            dropped += 1
            nonfinite += bad
            for s in group:
                s.dropped = "non-finite log-probabilities" if bad else "no signal"
            continue
        advantages = (rewards - mean) / (std + 1e-8) if normalize_std else rewards - mean
        for s, a in zip(group, advantages.tolist()):
            s.advantage = a
        kept.extend(s for s in group if s.trained)
    errors = sum(s.error is not None for s in samples)
    return Groups(kept, samples, dropped, len(samples) // max(samples_per_prompt, 1), errors, by_verifier, nonfinite)


def update_of(sample: Sample, updates: int) -> int:
    """Which of a rollout's `updates` optimizer updates trains `sample`: its prompt's position on the rank, mod K."""
    return sample.prompt % updates


def rows_needed(samples: list[Sample], prompts: Sequence[Prompt], seq_len: int, updates: int = 1) -> int:
    """How many rows of `seq_len` first-fit packing gives `samples` (`pack_rows` without building them); with
    `updates` K > 1, the most any one update's samples need."""
    return max(len(_placement([s for s in samples if update_of(s, updates) == u], prompts, seq_len)) for u in range(updates))


def _placement(samples, prompts, seq_len) -> list[list[int]]:
    fill: list[int] = []
    placed: list[list[int]] = []
    for k, s in enumerate(samples):
        n = len(prompts[s.prompt].ids) + len(s.tokens)
        if n > seq_len:
            raise ValueError(f"a sample of {n} tokens (prompt {prompts[s.prompt].index}) exceeds batch.seq_len {seq_len}")
        r = next((r for r in range(len(fill)) if fill[r] + n <= seq_len), len(fill))
        if r == len(fill):
            fill.append(0)
            placed.append([])
        fill[r] += n
        placed[r].append(k)
    return placed


def pack_rows(samples: list[Sample], prompts: Sequence[Prompt], seq_len: int, rows: int | None = None,
              updates: int = 1) -> dict[str, torch.Tensor]:
    """The samples as training rows (module docstring), at least `rows` of them (empty rows after); with `updates`
    K > 1, K blocks of rows one after the other, block k update k's samples (`update_of`), each block as many rows as
    the longest and at least `rows`."""
    blocks = [[k for k, s in enumerate(samples) if update_of(s, updates) == u] for u in range(updates)]
    placements = [[[block[i] for i in row] for row in _placement([samples[k] for k in block], prompts, seq_len)]
                  for block in blocks]
    per_block = max([rows or 0] + [len(p) for p in placements])
    placed = [row for p in placements for row in p + [[]] * (per_block - len(p))]  # [] pads: a row without samples
    n_rows = len(placed)
    ids = torch.zeros(n_rows, seq_len, dtype=torch.int64)
    labels = torch.full((n_rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros(n_rows, seq_len, dtype=torch.int64)
    sampled = torch.zeros(n_rows, seq_len, dtype=torch.float32)
    advantages = torch.zeros(n_rows, seq_len, dtype=torch.float32)
    lens: list[list[int]] = [[] for _ in range(n_rows)]
    for r, ks in enumerate(placed):
        at = 0
        for k in ks:
            s = samples[k]
            prompt = list(prompts[s.prompt].ids)
            seq = prompt + s.tokens
            n, p = len(seq), len(prompt)
            ids[r, at:at + n] = torch.tensor(seq)
            positions[r, at:at + n] = torch.arange(n)
            # position at + p - 1 + i predicts generated token i
            g = slice(at + p - 1, at + n - 1)
            labels[r, g] = torch.tensor(s.tokens)
            sampled[r, g] = torch.tensor(s.logprobs, dtype=torch.float32)
            advantages[r, g] = s.advantage
            lens[r].append(n)
            at += n
        if at < seq_len:
            positions[r, at:] = torch.arange(seq_len - at)
            lens[r].append(seq_len - at)
    width = max(len(x) for x in lens) if lens else 1
    doc_lens = torch.tensor([x + [0] * (width - len(x)) for x in lens], dtype=torch.int32).reshape(n_rows, width)
    return {"input_ids": ids, "labels": labels, "positions": positions, "doc_lens": doc_lens, "sampled": sampled,
            "advantages": advantages}
