"""The training data loader: deterministic global batches, each rank's slice, exact resume.

    loader = DataLoader(cfg, seq_len=4096, global_batch_size=512, dp_rank=rank, dp_world_size=world)
    loader.check_vocab(model_cfg.vocab_size)    # before step one
    batch = loader.next_batch()                 # this rank's rows of the next global batch
    train_state["data"] = loader.state_dict()   # ... and after a restart, on any world size:
    loader.load_state_dict(train_state["data"])

What a batch is. A dict of CPU tensors (pinned when CUDA is available) with
`global_batch_size(step) // dp_world_size` rows of `seq_len` tokens:
- `input_ids` int64 [B, T]: one instance per row (see `olmo_ds.data.dataset` for instances).
- `labels` int64 [B, T]: `input_ids` shifted left by one, the last position -100 (ignored).
- `doc_lens` int32 [B, D], only with `DataConfig.document_masking`: the lengths of the document
  pieces each row is cut into, from the shards' offsets index, zero-padded on the right; each row's
  non-zero entries sum to T. `olmo_ds.model.masking` turns it into flash-attn varlen's
  (`cu_seqlens`, `max_seqlen`) or a document-causal mask for flex_attention / SDPA.
Rank r holds rows [r * B, (r + 1) * B) of the global batch; the trainer cuts its rows into
micro-batches itself.

Fine-tuning data (masked sources, `DataLoader.masked`): each row is a packed row of whole
conversations (`olmo_ds.data.dataset`), and the batch differs thus:
- `input_ids`: the conversations, then the source's `pad_id` to `seq_len`.
- `labels`: `input_ids[t + 1]` where the loss mask of token t + 1 is 1, else -100 (OLMo-core's
  `get_labels`, `olmo_ds.model.loss.labels_from_mask`); also -100 at each conversation's last token
  (it never learns the next conversation's first token; the OLMo templates never train that token
  anyway) and at the row's end. Padding's mask is 0, so it is never a target.
- `doc_lens`: always (document masking is forced on): each conversation's length, then the padding
  as its own piece.
- `positions` int64 [B, T]: RoPE positions restarting at 0 in each piece, as OLMo-core does when it
  has document lengths (allenai/OLMo-core@fa6c501 src/olmo_core/nn/rope.py:547-555, reached from
  src/olmo_core/nn/attention/__init__.py:537,619) and as a conversation run alone sees them.
- `row_tokens` int64 [B]: conversation tokens per row (the rest is padding), for packing efficiency.

Preference data (DPO; `DataLoader.preference`, a masked source whose documents are (chosen, rejected)
pairs): rows pack pairs whole (`TokenSource.packing`), so each row is, in order, pair p0's chosen and
rejected conversations, pair p1's, ..., then padding; every key above is as for fine-tuning data (each side
its own piece of `doc_lens`, `labels` only on each side's final reply), plus
- `pair_ids` int64 [B, P]: the pairs of each row in row order, -1 padded (P = the most pairs in any row of
  the batch; 0 when every row is padding). Pair ids are global over the loader's sources: source k's pair
  j is `pair_offsets[k] + j`, the offsets in source order (`pair_offsets`), so a pair keeps its id in
  every epoch, on every rank and after a resume, and a cache of per-pair values (the reference model's
  log-probabilities) can be indexed by it. So the documents of row b are, in order, (chosen, rejected) of
  pair_ids[b, 0], then of pair_ids[b, 1], ...: document d of the row is pair d // 2's side d % 2.
A preference source mixes only with other preference sources.

RL prompts (GRPO; `DataLoader.prompts`, a source whose manifest says `prompts: true`): an instance is one prompt
(`olmo_ds.data.dataset`), the global batch size counts prompts, and rank r's share of global batch k is prompts
[r * B, (r + 1) * B) of it, in the same seeded order as any source, as a dict (lists, not padded rows: the
trainer generates from them):
- `prompt_ids` list[list[int]]: each prompt's ids (chat template, generation prompt appended);
- `prompt_index` int64 [B]: each prompt's global id, source k's prompt j being `prompt_offsets[k] + j`
  (`loader.prompt_offsets`, `DataLoader.num_prompts`): the same in every epoch, on every rank and after a resume,
  as DPO's `pair_ids`;
- `verifier` list[str], `ground_truth` list[object]: what scores a completion (`olmo_ds.eval.verifiers.reward`).
`seq_len` only bounds the prompts (one of `seq_len` tokens or more is refused when the loader opens). A prompt
source mixes only with other prompt sources. `validation_prompts` gives a rank its share of a validation source;
`DataLoader.verifiers` counts the prompts per verifier.

Order. Global batch k is the next `global_batch_size(k)` instance ids of the stream described in
`olmo_ds.data.order`, a function of (data, seed, batch-size schedule, seq_len) only. So the state is
two numbers, the step and the instances consumed, plus what they are valid for (seed, seq_len, data
fingerprint); restoring them on another world size continues with exactly the next global batch.

Prefetch. With `DataConfig.prefetch` > 0 a background thread assembles the next batches of this rank
while the GPU works; `wait_seconds` accumulates the time `next_batch` spent blocked on it, so the
trainer can log the data-wait share of step time.

Checked ids. Each batch's ids are compared with the vocabulary (the data's, and the model's once
`check_vocab` has run) as the batch is assembled, in the prefetch thread when there is one: an id
beyond it raises `DataError` naming the source, shard file, token and document, from `next_batch`
in the caller's thread, before that batch reaches the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.dataset import Prompt, TokenSource, check_ids
from olmo_ds.data.mixture import Mixture
from olmo_ds.data.order import BatchSizeSchedule, GlobalOrder
from olmo_ds.tokenizer import same_tokenizer

STATE_VERSION = 1
IGNORE_INDEX = -100


def _labels_for(input_ids: np.ndarray) -> np.ndarray:
    labels = np.empty_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    labels[:, -1] = IGNORE_INDEX
    return labels


def _to_tensors(arrays: dict[str, np.ndarray | torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
    if pin:
        out = {k: v.pin_memory() for k, v in out.items()}
    return out


def pair_offsets(sources: list[TokenSource]) -> np.ndarray:
    """The global id of each preference source's first pair: int64 [len(sources) + 1], the last entry the total
    (source k's pair j has id `offsets[k] + j`; see the module docstring)."""
    return np.concatenate([[0], np.cumsum([s.num_pairs for s in sources])]).astype(np.int64)


def prompt_offsets(sources: list[TokenSource]) -> np.ndarray:
    """The global id of each prompt source's first prompt: int64 [len(sources) + 1], the last entry the total."""
    return np.concatenate([[0], np.cumsum([s.num_prompts for s in sources])]).astype(np.int64)


def prompt_batch(sources: list[TokenSource], rows: list[tuple[int, int]], model_vocab_size: int | None = None) -> dict:
    """The batch of prompts `rows` ((source, prompt) each; see the module docstring), ids checked against the vocabulary."""
    offsets = prompt_offsets(sources)
    prompts = [sources[s].prompt(i) for s, i in rows]
    for (s, i), p in zip(rows, prompts):
        # A row of one prompt at its stream position: check_ids names the shard, token and document of a bad id.
        check_ids(np.asarray(p.ids, dtype=np.int64)[None, :], sources, [(s, int(sources[s].prompt_start[i]))], model_vocab_size, 1)
    return {"prompt_ids": [p.ids for p in prompts],
            "prompt_index": torch.tensor([int(offsets[s]) + i for s, i in rows], dtype=torch.long),
            "verifier": [p.verifier for p in prompts], "ground_truth": [p.ground_truth for p in prompts]}


def validation_prompts(source: SourceConfig | str | Path, dp_rank: int, dp_world_size: int) -> list[Prompt]:
    """This rank's share of a validation source of RL prompts: prompts dp_rank, dp_rank + dp_world_size, ... (ranks
    differ by at most one prompt), each `Prompt.index` its index within the source (0 .. its prompts - 1), in order."""
    src = TokenSource(source.path, source.name) if isinstance(source, SourceConfig) else TokenSource(source)
    if not src.prompts:
        raise ValueError(f"validation source {src.directory}: not RL prompts (its manifest lacks prompts: true); prepare it with "
                         "scripts/prepare_data.py --format rl")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} outside 0 .. dp_world_size - 1 = {dp_world_size - 1}")
    return [src.prompt(i) for i in range(dp_rank, src.num_prompts, dp_world_size)]


def packed_batch(sources: list[TokenSource], rows: list[tuple[int, int]], seq_len: int, pad_rows: int = 0,
                 model_vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """The batch arrays of packed rows: row b is packed row i of `sources[s]`, (s, i) = rows[b] (see the
    module docstring for the keys; preference sources add `pair_ids`); `pad_rows` more rows of padding only
    (no targets) are appended. Ids are checked against the vocabulary (`check_ids`)."""
    n, T = len(rows) + pad_rows, seq_len
    input_ids = np.empty((n, T), dtype=np.int64)
    mask = np.zeros((n, T), dtype=bool)
    pieces = []
    row_tokens = np.zeros(n, dtype=np.int64)
    for b, (s, i) in enumerate(rows):
        pieces.append(sources[s].read_packed(i, T, input_ids[b], mask[b]))
        row_tokens[b] = int(sources[s].packing(T).row_doc_lengths(i).sum())
    input_ids[len(rows):] = sources[0].pad_id
    pieces += [np.array([T], dtype=np.int64)] * pad_rows
    check_ids(input_ids[:len(rows)], sources, rows, model_vocab_size, T)
    labels = np.full((n, T), IGNORE_INDEX, dtype=np.int64)
    labels[:, :-1] = np.where(mask[:, 1:], input_ids[:, 1:], IGNORE_INDEX)
    positions = np.empty((n, T), dtype=np.int64)
    for b, p in enumerate(pieces):
        ends = np.cumsum(p)
        labels[b, ends - 1] = IGNORE_INDEX  # a conversation's last token predicts nothing (nor does the padding's)
        positions[b] = np.arange(T) - np.repeat(ends - p, p)
    batch = {"input_ids": input_ids, "labels": labels, "doc_lens": pad_doc_lens(pieces), "positions": positions, "row_tokens": row_tokens}
    if sources[0].preference:
        offsets = pair_offsets(sources)
        pairs = [offsets[s] + sources[s].row_pairs(i, T) for s, i in rows]
        pair_ids = np.full((n, max((len(p) for p in pairs), default=0)), -1, dtype=np.int64)
        for b, p in enumerate(pairs):
            pair_ids[b, :len(p)] = p
        batch["pair_ids"] = pair_ids
    return batch


def _open_sources(configs: list[SourceConfig], long_docs: str = "truncate", long_pairs: str = "refuse") -> list[TokenSource]:
    sources = [TokenSource(c.path, c.name, long_docs, long_pairs) for c in configs]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"data sources have duplicate names {names}; give each a distinct `name`")
    first = sources[0]
    for s in sources[1:]:
        if s.prompts != first.prompts:
            prompts, other = (first, s) if first.prompts else (s, first)
            raise ValueError(
                f"data sources {prompts.directory} (RL prompts: GRPO) and {other.directory} (not prompts) in one mixture: an RL "
                "step generates from prompts and scores the completions, which other data does not have; train them in separate "
                "stages, or prepare every source with --format rl"
            )
    for s in sources[1:]:
        if s.masked != first.masked:
            masked, plain = (first, s) if first.masked else (s, first)
            raise ValueError(
                f"data sources {masked.directory} (masked: fine-tuning conversations with a loss mask) and {plain.directory} "
                f"(no loss mask: pretraining text) in one mixture: a batch is either packed conversations trained on their "
                f"masked tokens or pretraining rows trained on every token; prepare both as chat data, or train them in separate stages"
            )
    for s in sources[1:]:
        if s.preference != first.preference:
            pairs, other = (first, s) if first.preference else (s, first)
            raise ValueError(
                f"data sources {pairs.directory} (preference pairs: DPO) and {other.directory} ({'fine-tuning conversations' if other.masked else 'pretraining text'}) "
                "in one mixture: a DPO step compares the two sides of each pair, which other data does not have; "
                "train them in separate stages (SFT, then DPO), or prepare every source with --format preference"
            )
    for s in sources[1:]:
        if not same_tokenizer(s.tokenizer_fingerprint, first.tokenizer_fingerprint):
            raise ValueError(
                f"data sources {first.directory} and {s.directory} were tokenized differently "
                f"({first.tokenizer_fingerprint} vs {s.tokenizer_fingerprint}); a mixture needs one tokenizer"
            )
    return sources


class DataLoader:
    """See the module docstring."""

    def __init__(self, cfg: DataConfig, *, seq_len: int, global_batch_size: int | BatchSizeSchedule, dp_rank: int, dp_world_size: int) -> None:
        if not cfg.sources:
            raise ValueError("data config: `sources` is empty; list at least one shard directory")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (an instance and its shifted labels), got {seq_len}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0 .. dp_world_size - 1 = {dp_world_size - 1}")
        self.cfg = cfg
        self.seq_len = int(seq_len)
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.schedule = BatchSizeSchedule.parse(global_batch_size)

        self.sources = _open_sources(cfg.sources, cfg.long_conversations, cfg.long_pairs)
        self.masked = self.sources[0].masked  # fine-tuning data: packed rows, a loss mask, the step's token mean
        self.preference = self.sources[0].preference  # DPO data: masked, rows of whole pairs, `pair_ids`
        self.pair_offsets = pair_offsets(self.sources)[:-1] if self.preference else np.zeros(0, dtype=np.int64)
        self.prompts = self.sources[0].prompts  # RL prompts: batches of prompts with their verifiers and ground truths
        self.prompt_offsets = prompt_offsets(self.sources)[:-1] if self.prompts else np.zeros(0, dtype=np.int64)
        if self.masked and cfg.document_masking is False:
            raise ValueError(
                f"data.document_masking: false, but {self.sources[0].directory} is a masked (fine-tuning) source: its rows pack "
                "several conversations, which must not attend to each other; remove the key (masked data turns document masking on)"
            )
        self.document_masking = bool(cfg.document_masking) or self.masked
        self.mixture = Mixture(
            [s.name for s in self.sources],
            [c.weight for c in cfg.sources],
            [c.max_epochs for c in cfg.sources],
            [s.num_instances(self.seq_len) for s in self.sources],
        )
        self.fingerprint = self._fingerprint()
        self.order = GlobalOrder(self.mixture, cfg.seed, key=f"{self.fingerprint}|{self.seq_len}", cache_dir=cfg.order_cache_dir)

        self.step = 0
        self.instances_consumed = 0
        self.wait_seconds = 0.0
        self._pin = torch.cuda.is_available()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._checked = False
        self._model_vocab_size: int | None = None  # set by check_vocab; every batch's ids are checked against it
        # The final size applies to every run, fresh or resumed; the rest is checked at the first batch.
        self._check_divisible(self.schedule.points[-1][0])

    # Facts the trainer cross-checks against the model and the checkpoint.
    @property
    def vocab_size(self) -> int:
        return self.sources[0].vocab_size

    @property
    def eos_id(self) -> int:
        return self.sources[0].eos_id

    @property
    def max_token_id(self) -> int:
        return max(s.max_token_id for s in self.sources)

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.sources[0].tokenizer_fingerprint

    @property
    def num_pairs(self) -> int:
        """Preference pairs over all sources: global pair ids run 0 .. num_pairs - 1 (0 for other data)."""
        return sum(s.num_pairs for s in self.sources)

    @property
    def num_prompts(self) -> int:
        """RL prompts over all sources: global prompt ids run 0 .. num_prompts - 1 (0 for other data)."""
        return sum(s.num_prompts for s in self.sources)

    @property
    def verifiers(self) -> dict[str, int]:
        """RL prompts per verifier name over all sources (their manifests' counts), e.g. for the trainer to refuse a
        reward configured for a verifier that no prompt names; {} for other data."""
        counts: dict[str, int] = {}
        for s in self.sources:
            for name, n in (s.manifest.extra.get("verifiers") or {}).items() if s.prompts else ():
                counts[name] = counts.get(name, 0) + n
        return dict(sorted(counts.items()))

    @property
    def epoch(self) -> int:
        return self.instances_consumed // self.mixture.epoch_size

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse a model whose embedding has fewer rows than the data's largest id needs.

        That reads the shards' metadata; each batch's ids are then checked against this size (and the
        data's vocabulary) as it is assembled, which finds a shard changed after its metadata was written.
        """
        self._model_vocab_size = int(model_vocab_size)
        worst = max(self.sources, key=lambda s: s.max_token_id)
        if worst.max_token_id >= model_vocab_size:
            raise ValueError(
                f"data source {worst.directory} holds token id {worst.max_token_id}, but the model's vocab_size is "
                f"{model_vocab_size}: the model needs vocab_size >= {worst.max_token_id + 1} (the tokenizer has {worst.vocab_size})"
            )

    def global_batch_size(self, step: int) -> int:
        return self.schedule.at(step)

    def mixture_report(self, total_instances: int | None = None) -> list[dict]:
        """Per source: its path, tokens on disk and the tail dropped by chunking, target vs actual
        share, tokens and passes per mixture epoch, and with `total_instances` (e.g. the run's
        length) the tokens it will contribute and how many times it will have been read."""
        rows = self.mixture.report(self.seq_len, total_instances)
        for row, src in zip(rows, self.sources):
            row["path"] = str(src.directory)
            row["tokens_on_disk"] = src.num_tokens
            if src.prompts:  # one prompt per instance: nothing is cut
                row["dropped_tail_tokens"] = 0
                row["prompts"] = src.num_prompts
            elif src.masked:  # packed rows: nothing is cut off the end; padding, truncation and drops instead
                p = src.packing(self.seq_len)
                row["dropped_tail_tokens"] = 0
                policy = {"long_pairs": src.long_pairs} if src.preference else {"long_conversations": src.long_docs}
                row["packing"] = {**p.summary(), **policy, "trained_tokens": int(src.manifest.extra.get("trained_tokens", 0))}
            else:
                row["dropped_tail_tokens"] = src.num_tokens - row["instances"] * self.seq_len
        return rows

    def _fingerprint(self) -> str:
        record = {
            "sources": [
                {**s.fingerprint_record(), "weight": c.weight, "max_epochs": c.max_epochs}
                for s, c in zip(self.sources, self.cfg.sources)
            ]
        }
        return "sha256:" + hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    # Batches.
    def _rows(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """Assemble the instances `ids` (global ids) into a batch."""
        src, inst = self.mixture.source_of(ids)
        T = self.seq_len
        if self.prompts:
            return prompt_batch(self.sources, list(zip(src.tolist(), inst.tolist())), self._model_vocab_size)
        if self.masked:
            batch = packed_batch(self.sources, list(zip(src.tolist(), inst.tolist())), T, model_vocab_size=self._model_vocab_size)
            return _to_tensors(batch, self._pin)
        input_ids = np.empty((len(ids), T), dtype=np.int64)
        rows = [(s, i) for s, i in zip(src.tolist(), inst.tolist())]
        for row, (s, i) in enumerate(rows):
            self.sources[s].read(i * T, input_ids[row])
        check_ids(input_ids, self.sources, rows, self._model_vocab_size)
        batch: dict = {"input_ids": input_ids, "labels": _labels_for(input_ids)}
        if self.cfg.document_masking:
            batch["doc_lens"] = pad_doc_lens([self.sources[s].doc_lengths(i * T, T) for s, i in zip(src.tolist(), inst.tolist())])
        return _to_tensors(batch, self._pin)

    def _make_batch(self, step: int, position: int) -> dict[str, torch.Tensor]:
        per_rank = self.schedule.at(step) // self.dp_world_size
        return self._rows(self.order.ids(position + self.dp_rank * per_rank, per_rank))

    def global_batch_instances(self, step: int, position: int | None = None) -> list[tuple[str, int]]:
        """(source name, first token in that source's stream) of every instance of global batch `step`
        (for masked data: (source name, packed row index)).

        `position` is the stream position the step starts at; by default the one the schedule gives
        (right for any run whose schedule never changed). This is how one finds which tokens a step saw.
        """
        if position is None:
            position = self.schedule.instances_before(step)
        src, inst = self.mixture.source_of(self.order.ids(position, self.schedule.at(step)))
        if self.masked or self.prompts:  # (source name, packed row index or prompt index)
            return [(self.sources[s].name, i) for s, i in zip(src.tolist(), inst.tolist())]
        return [(self.sources[s].name, i * self.seq_len) for s, i in zip(src.tolist(), inst.tolist())]

    def _produce(self, step: int, position: int, q: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> None:
            # Never block for good on a full queue: `close` must be able to stop this thread.
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        try:
            while not stop.is_set():
                put(self._make_batch(step, position))
                position += self.schedule.at(step)
                step += 1
        except BaseException as e:  # handed to the consumer, which re-raises it in the main thread
            put(e)

    def _check_divisible(self, from_step: int) -> None:
        # Only the sizes from `from_step` on: a run resumed on more ranks after a small warmup batch
        # size never needs to split that one again.
        for i, (step, size) in enumerate(self.schedule.points):
            ends = self.schedule.points[i + 1][0] if i + 1 < len(self.schedule.points) else None
            if (ends is None or ends > from_step) and size % self.dp_world_size:
                raise ValueError(f"global batch size {size} (from step {step}) is not divisible by the data-parallel world size {self.dp_world_size}")

    def _start_prefetch(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.cfg.prefetch)
        self._thread = threading.Thread(
            target=self._produce, args=(self.step, self.instances_consumed, self._queue, self._stop), name="olmo-ds-data", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the prefetch thread (the next `next_batch` starts a new one where this left off)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread = self._queue = None

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch; advances the loader state by one step."""
        if not self._checked:
            self._check_divisible(self.step)
            self._checked = True
        t0 = time.perf_counter()
        if self.cfg.prefetch <= 0:
            batch = self._make_batch(self.step, self.instances_consumed)
        else:
            if self._thread is None:
                self._start_prefetch()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            batch = item
        self.wait_seconds += time.perf_counter() - t0
        self.instances_consumed += self.schedule.at(self.step)
        self.step += 1
        return batch

    def give_back(self) -> None:
        """Undo the last `next_batch`: its batch is handed out again, by the next call or after a resume from the state
        saved next (a step that trained nothing: an RL rollout stopped by a signal)."""
        self.close()
        self.step -= 1
        self.instances_consumed -= self.schedule.at(self.step)

    def prompts_at(self, step: int) -> dict:
        """This rank's share of global batch `step` of RL prompts, without moving the loader: what `next_batch` returns
        (or returned) at that step, for in-flight rollouts, which decode the prompts of steps ahead of training. Pure in
        the step: its stream position is counted from the loader's own (step, instances consumed) through the batch-size
        schedule, which every `next_batch` moves together, so a schedule changed on resume holds here as there."""
        at = self.schedule.at
        position = self.instances_consumed + sum(at(k) for k in range(self.step, step)) - sum(at(k) for k in range(step, self.step))
        return self._make_batch(step, position)

    def prompt_draw(self, step: int, draw: int) -> dict:
        """This rank's share of extra draw `draw` (1, 2, ...) of RL prompts at step `step` (active sampling): a global
        batch of the step's size, at stream positions of the step's epoch chosen by (data.seed, step, draw), without
        repeats within the draw. The same on any number of ranks and after a resume; outside the training order, which
        stays as it is (the mixture's weights hold, as an epoch's positions carry them)."""
        size = self.schedule.at(step)
        per_rank, epoch = size // self.dp_world_size, self.mixture.epoch_size
        rng = np.random.default_rng([self.cfg.seed, step, draw])
        start = self.schedule.instances_before(step) // epoch * epoch
        positions = rng.choice(epoch, size=size, replace=size > epoch) + start
        mine = positions[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return self._rows(np.concatenate([self.order.ids(int(p), 1) for p in mine]))

    # Resume.
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "instances_consumed": self.instances_consumed,
            "epoch": self.epoch,
            "epoch_size": self.mixture.epoch_size,
            "seed": self.cfg.seed,
            "seq_len": self.seq_len,
            "fingerprint": self.fingerprint,
            "batch_size_schedule": self.schedule.to_list(),
        }

    def load_state_dict(self, state: dict, allow_data_change: bool | None = None) -> None:
        """Continue exactly after the batch the saved loader returned last.

        Refuses a state saved for other data, another seed or another seq_len unless
        `allow_data_change` (default: `DataConfig.allow_data_change`) is set; then training goes on at
        the same step and stream position of the new data. The world size may differ freely. A changed
        batch-size schedule applies from the restored step on.
        """
        if allow_data_change is None:
            allow_data_change = self.cfg.allow_data_change
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')!r}, this loader reads version {STATE_VERSION}")
        missing = {"step", "instances_consumed", "fingerprint", "seed", "seq_len"} - set(state)
        if missing:
            raise ValueError(f"data loader state lacks {sorted(missing)}; it was not written by DataLoader.state_dict()")
        mismatches = [
            f"{key}: checkpoint {state[key]!r}, now {now!r}"
            for key, now in (("fingerprint", self.fingerprint), ("seed", self.cfg.seed), ("seq_len", self.seq_len))
            if state[key] != now
        ]
        if mismatches and not allow_data_change:
            raise ValueError(
                "refusing to resume on different data (" + "; ".join(mismatches) + "). Set data.allow_data_change: true "
                "to continue on the new data at the same step"
            )
        self.close()
        self._checked = False
        self.step = int(state["step"])
        self.instances_consumed = int(state["instances_consumed"])


def validation_batches(
    source: SourceConfig | str | Path,
    seq_len: int,
    batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    *,
    document_masking: bool = False,
    long_docs: str = "truncate",
    long_pairs: str = "refuse",
) -> Iterator[dict[str, torch.Tensor]]:
    """A fixed, unshuffled pass over a validation source: every instance exactly once, in order.

    `batch_size` is rows per rank per batch. Global batch g is instances
    [g * batch_size * dp_world_size, (g + 1) * batch_size * dp_world_size), rank r taking its r-th
    block of `batch_size`. The last global batch is filled up with padding rows (input_ids EOS,
    labels all -100) so that every rank runs the same number of equally shaped batches; sum the
    loss over labels != -100 and count them to get the exact mean over real tokens.

    A masked (fine-tuning) source gives its packed rows in packing order (`long_docs` as
    `data.long_conversations`), batched as in training (module docstring; document masking always),
    its padding rows all `pad_id`: the loss over its labels is the masked validation loss. A preference
    source (`long_pairs` as `data.long_pairs`) gives rows of whole pairs with `pair_ids` numbered within
    this source (0 .. its pairs - 1; padding rows all -1).
    """
    # Opened and checked here, not at the first iteration, so bad data fails before training starts.
    if isinstance(source, SourceConfig):
        src = TokenSource(source.path, source.name, long_docs, long_pairs)
    else:
        src = TokenSource(source, long_docs=long_docs, long_pairs=long_pairs)
    if src.prompts:
        raise ValueError(f"validation source {src.directory}: RL prompts have no tokens to score a loss on; "
                         "read them with olmo_ds.data.loader.validation_prompts and score the completions")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} outside 0 .. dp_world_size - 1 = {dp_world_size - 1}")
    if batch_size < 1:
        raise ValueError(f"validation batch_size must be >= 1, got {batch_size}")
    return _validation_stream(src, src.num_instances(seq_len), seq_len, batch_size, dp_rank, dp_world_size, document_masking)


def _validation_stream(src: TokenSource, n: int, seq_len: int, batch_size: int, dp_rank: int, dp_world_size: int, document_masking: bool) -> Iterator[dict[str, torch.Tensor]]:
    per_global = batch_size * dp_world_size
    for g in range(math.ceil(n / per_global)):
        first = g * per_global + dp_rank * batch_size
        real = max(0, min(batch_size, n - first))
        if src.masked:
            yield _to_tensors(packed_batch([src], [(0, first + row) for row in range(real)], seq_len, batch_size - real), False)
            continue
        input_ids = np.full((batch_size, seq_len), src.eos_id, dtype=np.int64)
        for row in range(real):
            src.read((first + row) * seq_len, input_ids[row])
        check_ids(input_ids[:real], [src], [(0, first + row) for row in range(real)])
        labels = _labels_for(input_ids)
        labels[real:] = IGNORE_INDEX
        batch: dict = {"input_ids": input_ids, "labels": labels}
        if document_masking:
            rows = [src.doc_lengths((first + row) * seq_len, seq_len) for row in range(real)]
            rows += [np.array([seq_len])] * (batch_size - real)
            batch["doc_lens"] = pad_doc_lens(rows)
        yield _to_tensors(batch, False)


def pad_doc_lens(rows: list[np.ndarray]) -> torch.Tensor:
    """Stack variable-length per-instance document lengths into a zero-padded int32 [B, D] tensor (`doc_lens`)."""
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), dtype=np.int32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return torch.from_numpy(out)
