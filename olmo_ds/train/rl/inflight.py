"""In-flight rollouts (`rl.async_steps` A >= 1): the decode engine never drains between steps, and the weights of
each update are copied into it while sequences are in flight (open-instruct's `async_steps` with
`inflight_updates`, the OLMo 3 report's "in-flight updates", section 4.4.3), on one process per rank: the rank that
trains also decodes (colocated).

Why. A synchronous step (A = 0) decodes all its samples with one policy and waits for the longest; as the short ones
finish, the decode batch thins out until the last sample ends alone. With OLMo 3's length spread (a mean near 45% of
the limit, a long tail at it) half the decode slots idle. Here each rank keeps one decode copy of the policy and one
`olmo_ds.model.decode.Decoder` across steps, and the prompts of the next A steps wait in its queue: a finished
sequence's slot goes at once to a sample of a later step, so the slots stay full while the step's long samples end.

One step s (the trainer's step counter before the step: the weights have had s updates, "version s"):
1. `policy`: the engine's weights (ZeRO-3: gathered module by module, `rollout.gather_into`) are copied into the
   decode copy in place, between two decoder forwards; the cache and every sequence in flight stay, and go on under
   the new weights (their tokens from here are version s's). The decoder's `version` is set to s.
2. `collect`: the prompts of steps s .. s + A are submitted, each step's once (step s's from the batch the trainer
   passed, later ones from the loader's `prompts_at`, which is pure in the step), every sample keyed (step, prompt,
   sample) with today's `sample_key` seed, so its random stream is the one a synchronous run would use. The decoder
   runs until every sample of step s has finished; samples of later steps that finish meanwhile wait in `done`.
   A prompt enters at most A steps ahead of training, so no sample that trains started more than A versions ago;
   each sample records the versions its first and last token were drawn under (`Sample.versions`), its staleness
   is s minus the first, and a group with a sample staler than A (possible only when a run resumed with a lower A)
   is dropped ("stale") and counted, as open-instruct drops results older than async_steps.
3. The step trains on its samples exactly as a synchronous step (scoring, advantages, packing, reference, K
   updates: `olmo_ds.train.rl.grpo`). The off-policy part is corrected by the loss's truncated importance weight
   min(exp(old - sampled), rl.tis_cap) (`olmo_ds.model.loss.grpo_loss`): `sampled` is the decoder's log-probability
   of each token under the (older) weights that drew it, `old` the policy before this step's update, so the weight
   is pi_now / pi_decode per token, which is what staleness makes differ from 1; with rl.tis_cap off nothing
   corrects it.

Stopping. A stop request during `collect` raises `GenerationInterrupted` before a forward (the decoder is run one
finishing forward at a time, so nothing finished is lost), the step is abandoned on every rank (`grpo`), and the
decoder's state is as consistent as between any two forwards; a resumed run goes on from it.

Resume. `state_dict` is everything in flight on this rank: the decoder's sequences (tokens, random streams, cache
entries: `Decoder.state_dict`), the finished samples not trained yet, which steps' prompts were submitted. It is
saved per rank with each checkpoint (`<checkpoint>/rl_inflight/rank-NNNNN.pt`) and restored, not regenerated: its
samples were drawn partly under weights of earlier steps that no checkpoint holds, so only the saved tokens
continue the run exactly. So A >= 1 resumes on the same number of ranks only (each rank's queue is its prompts').
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from olmo_ds.checkpoint.safe_load import load_file
from olmo_ds.data.dataset import Prompt
from olmo_ds.model.decode import Decoder, Sampling
from olmo_ds.model.decode.engine import Completion
from olmo_ds.train.config import ConfigError, RLConfig
from olmo_ds.train.rl.rollout import Sample, empty_policy, gather_into, sample_requests

log = logging.getLogger("olmo_ds")

FORMAT = 1
STALE = "stale"


def inflight_file(rank: int) -> str:
    """Rank `rank`'s in-flight state, relative to its checkpoint directory."""
    return f"rl_inflight/rank-{rank:05d}.pt"


class InflightRollouts:
    """One rank's persistent decode copy, decoder and queue of finished samples (module docstring). `prompts_at(step)`:
    this rank's prompts of any step (the loader's `prompts_at`); `max_len`: the decoder's longest prompt + new
    tokens (batch.seq_len); `lengths`: benchmarks' per-sample limits (`rollout.sample_requests`)."""

    def __init__(self, rl: RLConfig, *, max_len: int, stop_ids: Sequence[int], tokenizer,
                 prompts_at: Callable[[int], list[Prompt]], lengths: Callable | None = None):
        self.rl, self.max_len, self.stop_ids, self.tokenizer = rl, max_len, list(stop_ids), tokenizer
        self.prompts_at, self.lengths = prompts_at, lengths
        self.policy = None
        self.decoder: Decoder | None = None
        self.submitted = -1  # the last step whose prompts are in the decoder
        self.indices: dict[int, list[int]] = {}  # step -> its prompts' global ids, for each step submitted and not trained
        self.done: dict[tuple, Completion] = {}  # (step, prompt, sample) -> a finished sample of a step not trained yet
        self.finished: Counter = Counter()  # step -> its samples in `done`
        self._restored: dict | None = None  # a checkpoint's decoder state, loaded when the decoder is built

    @contextlib.contextmanager
    def policy_at(self, module, dtype: torch.dtype, step: int, timings: dict):
        """The decode copy holding the engine's weights after `step` updates (module docstring, 1), kept on exit."""
        if self.policy is None:
            t0 = time.perf_counter()
            self.policy = empty_policy(module, dtype)
            gather_into(self.policy, module, dtype)
            rl = self.rl
            self.decoder = Decoder(self.policy, slots=rl.generation_batch_size, max_len=self.max_len,
                                   sampling=Sampling(temperature=rl.temperature, top_p=rl.top_p, seed=rl.seed),
                                   stop_ids=self.stop_ids, tokenizer=self.tokenizer)
            if self._restored is not None:
                try:
                    self.decoder.load_state_dict(self._whole(self._restored))
                except ValueError as e:
                    raise ConfigError(f"rl.async_steps: the checkpoint's samples in flight do not fit this run's decoder ({e}); "
                                      f"resume with the checkpoint's rl.generation_batch_size and batch.seq_len") from None
                self._restored = None
            timings["gather"] = timings.get("gather", 0.0) + time.perf_counter() - t0
        else:
            gather_into(self.policy, module, dtype, timings)  # in place: the sequences in flight go on under these weights
        self.decoder.version = step  # one version per optimizer step (its K updates): a sample's staleness is in steps
        yield self.policy

    def collect(self, step: int, prompts: list[Prompt], should_stop: Callable[[], bool] | None, stats: dict) -> list[Sample]:
        """Step `step`'s samples (prompt-major, as `rollout.sample_groups` returns them), each with its `versions`,
        stale groups marked (module docstring, 2); they stay queued until `commit`. Adds the step's decode rows, slots
        and staleness to `stats`.
        Raises `GenerationInterrupted` when `should_stop()` turned True (the decoder stays consistent)."""
        rl, g, ahead = self.rl, self.rl.samples_per_prompt, self.rl.async_steps
        mine = [p.index for p in prompts]
        if self.indices.setdefault(step, mine) != mine:
            raise ConfigError(f"step {step}: the samples in flight were drawn for prompts {self.indices[step][:4]}..., but the "
                              f"loader gives {mine[:4]}... (the data changed on resume?); resume with the checkpoint's data, or "
                              f"with rl.async_steps 0, which draws every step's samples again")
        for t in range(max(self.submitted + 1, step), step + ahead + 1):
            part = prompts if t == step else self.prompts_at(t)
            self.indices[t] = [p.index for p in part]
            pairs = [(p, j) for p in part for j in range(g)]
            self.decoder.submit(sample_requests(pairs, step=t, seed=rl.seed, max_new_tokens=rl.max_new_tokens, stop=rl.stop,
                                                lengths=self.lengths), keys=[(t, k // g, k % g) for k in range(len(pairs))])
            self.submitted = t
        want = len(prompts) * g
        dec = self.decoder
        rows, slots = dec.stats["decode_rows"], dec.stats["slot_steps"]
        try:
            while self.finished[step] < want:
                if not dec.pending:
                    raise RuntimeError(f"step {step}: {want - self.finished[step]} samples neither finished nor in the decoder")
                # one finishing forward a run: an interrupt raised by the next run loses nothing that finished
                for key, completion in dec.run(until=lambda: True, interrupt=should_stop):
                    self.done[key] = completion
                    self.finished[key[0]] += 1
        finally:
            stats["decode_rows"] = stats.get("decode_rows", 0) + dec.stats["decode_rows"] - rows
            stats["slot_steps"] = stats.get("slot_steps", 0) + dec.stats["slot_steps"] - slots
        samples = []
        for j in range(len(prompts)):
            group = [self._sample(self.done[step, j, i], j, i) for i in range(g)]
            if max(step - s.versions[0] for s in group) > ahead:
                for s in group:
                    s.dropped = STALE
            samples += group
        staleness = [step - s.versions[0] for s in samples]
        stats.update(stale_dropped=stats.get("stale_dropped", 0) + sum(s.dropped == STALE for s in samples),
                     staleness_sum=stats.get("staleness_sum", 0) + sum(staleness), staleness_n=stats.get("staleness_n", 0) + len(samples),
                     staleness_max=max([stats.get("staleness_max", 0), *staleness]))
        return samples

    def commit(self, step: int) -> None:
        """Step `step` trains (every rank agreed): its samples leave the queue. Until then they stay, so that a step
        abandoned on another rank's stop request after this rank had all its samples keeps them for the resume."""
        for key in [k for k in self.done if k[0] == step]:
            del self.done[key]
        self.finished.pop(step, None)
        self.indices.pop(step, None)

    @staticmethod
    def _sample(c: Completion, prompt: int, index: int) -> Sample:
        return Sample(prompt=prompt, index=index, tokens=list(c.tokens), logprobs=[float(x) for x in c.logprobs], finish=c.finish,
                      text=c.text or "", versions=tuple(c.versions))

    @property
    def holds(self) -> bool:
        """Whether there is a state to save (after the first rollout, or restored from a checkpoint)."""
        return self.decoder is not None or self._restored is not None

    def close(self) -> None:
        """Free the decode copy and its cache (what stays resident between steps)."""
        self.policy = self.decoder = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # --- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict | None:
        """Everything in flight on this rank, as tensors and plain data (loads with weights_only=True); None before any
        rollout. Each sequence's cache entries are cut to the positions it has written (`_cut`)."""
        decoder = self._cut(self.decoder.state_dict()) if self.decoder is not None else self._restored
        if decoder is None:
            return None
        return {"format": FORMAT, "async_steps": self.rl.async_steps, "submitted": self.submitted, "decoder": decoder,
                "indices": [[t, list(v)] for t, v in sorted(self.indices.items())],
                "done": [[list(k), list(c.tokens), list(c.logprobs), c.finish, c.text, list(c.versions)] for k, c in self.done.items()]}

    @staticmethod
    def _cut(state: dict) -> dict:
        """The decoder's state with each active sequence's cache entries ([kv_heads, length, head_dim] a layer) cut to the
        positions it has written (its prompt and all but its last token; a sliding layer's ring stays whole when the
        sequence has filled it): the file holds what is in flight, not slots x max_len. The positions cut are never
        attended (each sequence reads its own first positions only), so zeros restored there change nothing."""
        for a in state["active"]:
            n = len(a["request"][0]) + len(a["tokens"]) - 1
            a["keys"], a["values"] = [[t[:, :n].clone() for t in a[k]] for k in ("keys", "values")]
        return state

    def _whole(self, state: dict) -> dict:
        """`_cut`'s entries zero-padded back to this decoder's cache lengths (what `Decoder.load_state_dict` copies)."""
        cache = self.decoder.cache
        for a in state["active"]:
            for k, layers in (("keys", cache.keys), ("values", cache.values)):
                a[k] = [torch.cat([t, t.new_zeros(t.shape[0], layer.shape[2] - t.shape[1], t.shape[2])], 1) if t.shape[1] < layer.shape[2]
                        else t for t, layer in zip(a[k], layers)]
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != FORMAT:
            raise ConfigError(f"rl.async_steps: the checkpoint's in-flight state has format {state.get('format')!r}; this version "
                              f"reads {FORMAT}")
        self.submitted = int(state["submitted"])
        self.indices = {int(t): list(v) for t, v in state["indices"]}
        self.done = {tuple(k): Completion(list(tokens), finish, text, list(logprobs), tuple(versions))
                     for k, tokens, logprobs, finish, text, versions in state["done"]}
        self.finished = Counter(k[0] for k in self.done)
        self._restored = state["decoder"]
        if state["async_steps"] != self.rl.async_steps:
            log.info("rl.async_steps %d (the checkpoint's: %d): the samples in flight go on; those started more than %d versions "
                     "before the step that trains them are dropped as stale", self.rl.async_steps, state["async_steps"],
                     self.rl.async_steps)


def restore_inflight(resume_dir: Path | None, resume_state: dict | None, *, rank: int, world_size: int, async_steps: int) -> dict | None:
    """This rank's in-flight state from the checkpoint resumed (None: a new run, or one saved without samples in
    flight). Refuses another world size: each rank's queue holds its own prompts' samples."""
    saved = (resume_state or {}).get("rl_inflight")
    if resume_dir is None or not saved:
        return None
    if not async_steps:
        log.info("rl.async_steps 0: the %s's samples in flight (rl.async_steps %d) are not used; each step draws its samples "
                 "again, synchronously", resume_dir, saved["async_steps"])
        return None
    if saved["world_size"] != world_size:
        raise ConfigError(f"{resume_dir} was saved by {saved['world_size']} ranks with rl.async_steps {saved['async_steps']}, this "
                          f"run has {world_size}: each rank's samples in flight are its own prompts', so an in-flight run resumes "
                          f"on its number of ranks only (or set rl.async_steps 0 to draw every step's samples again)")
    return load_file(Path(resume_dir) / inflight_file(rank))
