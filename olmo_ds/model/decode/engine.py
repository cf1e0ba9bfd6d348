"""Batched generation: prompts of any lengths decoded together through one `SlotCache`.

The schedule (continuous batching): up to `batch_size` sequences hold a cache slot each. Waiting prompts
take free slots and are prefilled together, laid end to end in one row (no padding; at most
`prefill_tokens` tokens per forward); then every sequence with a slot advances by one token in one
forward of `[active, 1]`. A sequence leaves at its EOS (or another stop id, a chat model's turn end), once
its text contains one of its stop strings, or at its own `max_new_tokens`; its slot goes to the next
waiting prompt at once, so a finished sequence costs nothing from the next step on.

Greedy decoding does, per sequence, the arithmetic of transformers' `generate` (the same attention over the
same keys, head on the last position), so the outputs are the same tokens at any batch size
(tests/model/test_decode.py, fp32 on CPU, OLMo 2 and OLMo 3 with windows shorter than prompt + output). On CPU
a sample's tokens and log-probabilities are also the same bits whatever shares its batch (`cache`'s module
docstring says how; on a GPU they are not).

On a GPU a decode step's rows are the active sequences padded to a bucket (`cache.row_bucket`), its arithmetic is
compiled (`compiled.CompiledStep`, `compile=`) and it replays a CUDA graph per (rows, span) (`graphs.DecodeGraphs`,
`cuda_graphs=`), one step ahead of the host whenever no prompt waits for a slot; a prefill wave is one
variable-length attention forward (`cache`).

Everything a request could get wrong is refused before the first forward (`check_requests`).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from olmo_ds.model.decode.cache import SlotCache, check_fits, decode_span, padded_rows, row_bucket
from olmo_ds.model.decode.compiled import CompiledStep
from olmo_ds.model.decode.forward import forward_logits
from olmo_ds.model.decode.graphs import DecodeGraphs
from olmo_ds.model.decode.sampling import Sampling, next_tokens
from olmo_ds.model.model import OLMo

FINISH_REASONS = ("eos", "stop", "length")


@dataclass(frozen=True)
class Request:
    """A prompt's ids, how many new tokens it may get, and the strings that end its text. `seed` (sampling only):
    the key of this sample's random stream, in [0, 2**32); by default the request's index in the list. Give it to
    draw the same tokens wherever the request sits (RL's samples are keyed by step, prompt and sample number, so a
    resume or another rank layout draws them again)."""

    prompt: Sequence[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass
class Completion:
    """`tokens`: the new ids (the EOS or stop id that ended it included). `finish`: eos, stop or length.
    `text` (with a tokenizer): the decoded reply without that id, cut before the first stop string.
    `logprobs[i]`: the float32 log-probability of `tokens[i]` under the distribution it was drawn from (temperature,
    top-k and top-p applied: `sampling.filtered_logits`; greedy: the model's own), what an RL importance ratio divides
    by. `versions`: the weights' version (`Decoder.version`) its first and its last token were drawn under (they differ
    when `Decoder.load_weights` swapped the weights while it was decoding). Neither is part of equality: two runs that
    decode the same tokens are the same completion."""

    tokens: list[int]
    finish: str
    text: str | None = None
    logprobs: list[float] = field(default_factory=list, compare=False)
    versions: tuple[int, int] = field(default=(0, 0), compare=False)  # `Decoder.version` at its first and last token


class GenerationInterrupted(RuntimeError):
    """`interrupt()` asked `generate` or `Decoder.run` to stop. `finished`: the (key, completion) pairs that run had
    finished before it stopped (out of the decoder now, so a later `run` does not return them again); `generate`
    returns nothing of a stopped run."""

    def __init__(self, message: str, finished: Sequence = ()):
        super().__init__(message)
        self.finished = list(finished)


@dataclass
class Generation:
    completions: list[Completion]
    stats: dict = field(default_factory=dict)


def check_requests(requests: Sequence[Request], cfg, *, has_tokenizer: bool, names: Sequence[str] | None = None) -> None:
    """Every refusal that needs no model: empty or too long prompts, ids outside the vocabulary, limits, stop
    strings. `names[n]` says where request n came from (a file's line), else "prompt n"."""
    if not requests:
        raise ValueError("nothing to generate: no prompts")
    for n, r in enumerate(requests):
        where = names[n] if names else f"prompt {n}"
        if not r.prompt:
            raise ValueError(f"{where}: the prompt is empty (every prompt needs at least one token)")
        if len(r.prompt) >= cfg.max_seq_len:
            raise ValueError(f"{where}: the prompt has {len(r.prompt)} tokens and the model's context is {cfg.max_seq_len}, which leaves "
                             f"no room for a new token; shorten the prompt to at most {cfg.max_seq_len - 1} tokens")
        if isinstance(r.max_new_tokens, bool) or not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
        if len(r.prompt) + r.max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"{where}: {len(r.prompt)} tokens + max_new_tokens {r.max_new_tokens} exceed the model's context "
                             f"of {cfg.max_seq_len}; lower max_new_tokens to {cfg.max_seq_len - len(r.prompt)}")
        bad = [i for i in r.prompt if not 0 <= i < cfg.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the model's vocabulary of {cfg.vocab_size}")
        for s in r.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"{where}: stop strings must be non-empty strings, got {s!r}")
        if r.seed is not None and (isinstance(r.seed, bool) or not isinstance(r.seed, int) or not 0 <= r.seed < 2 ** 32):
            raise ValueError(f"{where}: seed must be an integer in [0, 2**32), got {r.seed!r}")
        if r.stop and not has_tokenizer:
            raise ValueError(f"{where}: stop strings need the tokenizer (to read the text)")


class _Sequence:
    """A request being decoded: its slot, its new ids, and the token waiting to enter the cache."""

    def __init__(self, key, request: Request, slot: int, generator, version: int = 0):
        self.key, self.request, self.slot, self.generator = key, request, slot, generator
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.versions = (version, version)  # the policy versions (`Decoder.version`) of its first and its last token
        # Tokens whose decoded text can hold a whole stop string (a byte-level token may be one byte of a character).
        self.stop_window = 4 * max((len(s) for s in request.stop), default=0) + 4

    @property
    def position(self) -> int:
        """Where the next token (the last new one, not yet in the cache) goes."""
        return len(self.request.prompt) + len(self.tokens) - 1

    def add(self, token: int, logprob: float, stop_ids: frozenset[int], tokenizer, version: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions = (self.versions[0], version)
        if token in stop_ids:
            self.finish = "eos"
        elif self.request.stop and any(s in tokenizer.decode(self.tokens[-self.stop_window:]) for s in self.request.stop):
            self.finish = "stop"
        elif len(self.tokens) == self.request.max_new_tokens:
            self.finish = "length"


def _completion(seq: _Sequence, tokenizer) -> Completion:
    if tokenizer is None:
        return Completion(seq.tokens, seq.finish, logprobs=seq.logprobs, versions=seq.versions)
    text = tokenizer.decode(seq.tokens[:-1] if seq.finish == "eos" else seq.tokens)
    cut = min((i for i in (text.find(s) for s in seq.request.stop) if i >= 0), default=len(text))
    return Completion(seq.tokens, seq.finish, text[:cut], seq.logprobs, seq.versions)


class Decoder:
    """The decode engine over a stream of requests: `submit` queues requests, `run` decodes until every one has
    finished or until `run`'s `until()` says so, and keeps the sequences in flight (their slots and cache entries) for
    the next `run`. `load_weights` swaps the model's weights in place between two forwards without touching the cache:
    the sequences in flight go on under the new weights (RL's in-flight updates), and each completion records the
    `version` of its first and its last token. `state_dict` / `load_state_dict` save and restore everything in flight
    (waiting requests, each active sequence's tokens, random stream and cache entries), so that a restored decoder
    decodes on exactly as the saved one would have. `generate` is one submit and one run.

    `slots`: sequences decoded together (the cache's slots); `max_len`: the longest prompt + new tokens a request may
    have (the cache's length). The other arguments are `generate`'s."""

    def __init__(self, model: OLMo, *, slots: int, max_len: int, sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (),
                 tokenizer=None, cache_budget: int | None = None, prefill_tokens: int | None = None, cuda_graphs: bool | None = None,
                 attention: str = "auto", compile: bool | None = None):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {slots!r}")
        self.model, self.cfg, self.sampling, self.tokenizer = model, model.cfg, sampling, tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs the model on a CUDA device, not {self.device}")
        if compile and self.device.type != "cuda":
            raise ValueError(f"compile (the compiled decode step) needs the model on a CUDA device, not {self.device}")
        self.slots, self.max_len = slots, max_len
        self.per_sequence = check_fits(self.cfg, slots, max_len, self.dtype, self.device, cache_budget)
        self.prefill_tokens = prefill_tokens or (32768 if self.device.type == "cuda" else 8192)
        self.stop_ids = frozenset(stop_ids)
        gpu = self.device.type == "cuda"
        # On a GPU one slot more, the padding rows' scratch (`cache.row_bucket`): within the budget's margin (GPU_SHARE)
        self.cache = SlotCache(self.cfg, slots, max_len, self.device, self.dtype, attention, scratch=gpu)
        self.step = CompiledStep(model) if gpu and compile is not False else None
        self.graphs = DecodeGraphs(model, self.cache, self.step) if gpu and cuda_graphs is not False else None
        self.waiting: deque[tuple[object, Request]] = deque()
        self.free = list(range(slots))  # a heap: the lowest free slot first keeps the active ones contiguous
        self.active: dict[int, _Sequence] = {}
        self.version = 0  # weights swapped in so far (`load_weights`)
        self.stats = {"prefill_forwards": 0, "decode_forwards": 0, "decode_rows": 0, "prompt_tokens": 0, "new_tokens": 0,
                      "prefill_seconds": 0.0, "decode_seconds": 0.0, "slot_steps": 0, "decode_cache_reads": 0}
        self._count = 0  # requests submitted: the default key of the next one
        pinned = self.device.type == "cuda"
        self._buffers = [(torch.empty(slots, dtype=torch.long, pin_memory=pinned), torch.empty(slots, dtype=torch.float32, pin_memory=pinned),
                          torch.cuda.Event() if pinned else None) for _ in range(2)] if self.graphs is not None else []

    def submit(self, requests: Sequence[Request], keys: Sequence | None = None, names: Sequence[str] | None = None) -> None:
        """Queue `requests` (checked first: `check_requests`, and each must fit `max_len`), each with its key (what `run`
        returns it with; default: its number among all requests submitted). A request's random stream is keyed by its
        `seed`, else by its number."""
        check_requests(requests, self.cfg, has_tokenizer=self.tokenizer is not None, names=names)
        for n, r in enumerate(requests):
            if len(r.prompt) + r.max_new_tokens > self.max_len:
                where = names[n] if names else f"prompt {n}"
                raise ValueError(f"{where}: {len(r.prompt)} tokens + max_new_tokens {r.max_new_tokens} exceed the decoder's "
                                 f"max_len {self.max_len}")
        for n, r in enumerate(requests):
            key = self._count + n if keys is None else keys[n]
            self.waiting.append((key, r if r.seed is not None else Request(r.prompt, r.max_new_tokens, r.stop, self._count + n)))
        self._count += len(requests)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet returned: waiting, or decoding."""
        return len(self.waiting) + len(self.active)

    @torch.no_grad()
    def load_weights(self, source: OLMo | dict[str, torch.Tensor]) -> None:
        """Copy `source`'s weights (a model, or a state dict of its tensors) into the decoding model in place, between
        two forwards; the cache and every sequence in flight stay. The next forward runs the new weights, and
        `version` counts the swap. In place, so CUDA graphs captured earlier replay the new weights."""
        state = source.state_dict() if isinstance(source, torch.nn.Module) else source
        mine = self.model.state_dict()
        missing = set(mine) - set(state)
        if missing:
            raise ValueError(f"load_weights: the new weights lack {', '.join(sorted(missing)[:3])}")
        for name, t in mine.items():
            t.copy_(state[name])
        self.version += 1

    def run(self, *, until: Callable[[], bool] | None = None, interrupt: Callable[[], bool] | None = None,
            progress: Callable[[int, int, int], None] | None = None) -> list[tuple[object, Completion]]:
        """Decode until nothing is waiting or in flight, or until `until()` (asked after every forward that finished a
        sequence) is True; returns the (key, completion) pairs finished by this call, in the order they finished.
        `interrupt()` is asked before every forward: True raises `GenerationInterrupted` (holding what this call finished),
        and the decoder stays as it was before that forward (a later `run` goes on). `progress(finished, total, new_tokens)`: after every forward."""
        model, was_training = self.model, self.model.training
        model.eval()
        finished: list[tuple[object, Completion]] = []
        total = len(finished) + self.pending
        try:
            while self.waiting or self.active:
                if interrupt is not None and interrupt():
                    raise GenerationInterrupted(f"generation stopped on request with {len(finished)} of {total} sequences done", finished)
                before = len(finished)
                began = time.perf_counter()  # each branch ends reading its tokens back, so the host clock covers its GPU work
                if self.waiting and self.free:
                    self._prefill(finished)
                    self.stats["prefill_seconds"] += time.perf_counter() - began
                elif self.graphs is not None and self.graphs.enabled and self._graph_steps(
                        [self.active[slot] for slot in sorted(self.active)], finished, total, progress):
                    self.stats["decode_seconds"] += time.perf_counter() - began
                else:
                    self._decode_step(finished)
                    self.stats["decode_seconds"] += time.perf_counter() - began
                if progress is not None:
                    progress(len(finished), total, self.stats["new_tokens"])
                if until is not None and len(finished) > before and until():
                    break
        finally:
            model.train(was_training)
        return finished

    def _keep(self, seqs: list[_Sequence], chosen: tuple[torch.Tensor, torch.Tensor], finished: list) -> bool:
        """Add each sequence's next token (sequences already finished skip theirs); whether any finished."""
        any_finished = False
        for seq, token, logprob in zip(seqs, chosen[0].tolist(), chosen[1].tolist()):
            if seq.finish:  # finished one step earlier (pipelined graph steps): this token was decoded past its end
                continue
            seq.add(token, logprob, self.stop_ids, self.tokenizer, self.version)
            self.stats["new_tokens"] += 1
            if seq.finish:
                any_finished = True
                finished.append((seq.key, _completion(seq, self.tokenizer)))
                del self.active[seq.slot]
                heapq.heappush(self.free, seq.slot)
        return any_finished

    def _prefill(self, finished: list) -> None:
        """Waiting prompts into free slots, laid end to end in one row, and each one's first token."""
        cache, device = self.cache, self.device
        wave, total = [], 0
        while self.waiting and self.free and (not wave or total + len(self.waiting[0][1].prompt) <= self.prefill_tokens):
            key, request = self.waiting.popleft()
            wave.append(_Sequence(key, request, heapq.heappop(self.free), self.sampling.generator(request.seed), self.version))
            total += len(request.prompt)
        lengths = [len(s.request.prompt) for s in wave]
        pad = padded_rows(total, cache.invariant) - total  # on CPU: padding positions, attended by nothing
        ids = torch.tensor([[t for s in wave for t in s.request.prompt] + [0] * pad], device=device)
        positions = torch.tensor([[p for n in lengths for p in range(n)] + [0] * pad], device=device)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        last = torch.cat([last, last[-1:].expand(padded_rows(len(wave), cache.invariant) - len(wave))])
        cache.prefill([s.slot for s in wave], lengths, total + pad)
        logits = forward_logits(self.model, ids, positions, cache, last)[:len(wave)]
        for s in wave:
            self.active[s.slot] = s
        self._keep(wave, next_tokens(logits, self.cfg.vocab_size, self.sampling, [s.generator for s in wave]), finished)
        self.stats["prefill_forwards"] += 1
        self.stats["prompt_tokens"] += total

    def _decode_step(self, finished: list) -> None:
        """One new token for every active sequence, eagerly (graphs off, or a capture failed). Its rows are those a
        graph would run: on a GPU padded to `row_bucket` with scratch rows, on CPU to whole ROW_MULTIPLEs by
        repeating the last sequence's row (`padded_rows`)."""
        cache, device = self.cache, self.device
        seqs = [self.active[slot] for slot in sorted(self.active)]
        span = decode_span(max(s.position for s in seqs) + 1, self.max_len)
        rows = [(s.tokens[-1], s.position, s.slot) for s in seqs]
        if cache.scratch is not None:
            rows += [(0, 0, cache.scratch)] * (row_bucket(len(seqs), self.slots) - len(seqs))
        else:
            rows += rows[-1:] * (padded_rows(len(seqs), cache.invariant) - len(seqs))
        ids = torch.tensor([[t] for t, _, _ in rows], device=device)
        positions = torch.tensor([p for _, p, _ in rows], device=device)
        slot_ids = [slot for _, _, slot in rows]
        contiguous = cache.kernel == "sdpa" and slot_ids == list(range(len(rows)))  # as `DecodeGraphs.logits` decides
        cache.decode(torch.tensor(slot_ids, device=device), positions, span, contiguous=contiguous,
                     host=[(slot, p) for _, p, slot in rows] if cache.invariant else None)
        logits = forward_logits(self.model, ids, positions[:, None], cache, torch.arange(len(rows), device=device), self.step)[:len(seqs)]
        self._count_step(seqs, 0)
        self._keep(seqs, next_tokens(logits, self.cfg.vocab_size, self.sampling, [s.generator for s in seqs]), finished)

    def _count_step(self, seqs: list[_Sequence], ahead: int) -> None:
        """Count a decode step of `seqs`, each `ahead` tokens past its last kept one (pipelined steps). `decode_cache_reads`:
        the cache entries its attention must read, summed over rows and layers (a row at position p reads p + 1 in a
        full layer, at most the window in a sliding one): with the weights, the bytes bound of the step (bench_generate)."""
        cfg, stats = self.cfg, self.stats
        sliding = sum(cfg.layer_is_sliding(i) for i in range(cfg.n_layers))
        lengths = [s.position + ahead + 1 for s in seqs]
        stats["decode_cache_reads"] += (cfg.n_layers - sliding) * sum(lengths) + (
            sliding * sum(min(n, cfg.sliding_window) for n in lengths) if sliding else 0)
        stats["decode_forwards"] += 1
        stats["decode_rows"] += len(seqs)
        stats["slot_steps"] += self.slots

    def _graph_steps(self, seqs: list[_Sequence], finished: list, total: int, progress) -> bool:
        """Decode steps of the active sequences `seqs` (any number of them: `DecodeGraphs` pads them to a bucket) as
        graph replays, one step ahead of the host: step k+1 is launched with the tokens step k left on the device
        before the host reads step k's tokens back (through pinned buffers), so the GPU never waits for the host's
        bookkeeping. The run calls this only when no waiting prompt has a free slot to take, so the sequences stay
        the same until one finishes. A step is launched only while no sequence can have reached its max_new_tokens,
        so no position passes the cache; once a sequence finishes, the step in flight is read (its tokens for the
        others are theirs, the finished one's is dropped) and the run returns. False when graphs are off (a capture
        failed): the caller steps eagerly."""
        device, graphs = self.device, self.graphs
        slots = [s.slot for s in seqs]
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=device)
        positions = torch.tensor([s.position for s in seqs], device=device)
        in_flight: list[tuple] = []
        launched = 0
        while True:
            if all(len(s.tokens) + len(in_flight) < s.request.max_new_tokens for s in seqs):
                span = decode_span(max(s.position for s in seqs) + len(in_flight) + 1, self.max_len)
                logits = graphs.logits(ids, positions, slots, span)
                if logits is None:  # a capture failed and turned graphs off: read what is in flight, then step eagerly
                    for host_ids, host_logp, event in in_flight:
                        event.synchronize()
                        self._keep(seqs, (host_ids, host_logp), finished)
                    return launched > 0
                chosen = next_tokens(logits, self.cfg.vocab_size, self.sampling, [s.generator for s in seqs])
                host_ids, host_logp, event = self._buffers[launched % 2]
                host_ids, host_logp = host_ids[:len(seqs)], host_logp[:len(seqs)]
                host_ids.copy_(chosen[0], non_blocking=True)
                host_logp.copy_(chosen[1], non_blocking=True)
                event.record()
                in_flight.append((host_ids, host_logp, event))
                self._count_step(seqs, len(in_flight) - 1)
                ids, positions = chosen[0][:, None], positions + 1
                launched += 1
                if len(in_flight) < 2:
                    continue
            host_ids, host_logp, event = in_flight.pop(0)
            event.synchronize()
            if self._keep(seqs, (host_ids, host_logp), finished):
                for host_ids, host_logp, event in in_flight:
                    event.synchronize()
                    self._keep(seqs, (host_ids, host_logp), finished)
                return True
            if progress is not None:
                progress(len(finished), total, self.stats["new_tokens"])

    def occupancy(self) -> float:
        """The mean share of slots that held a sequence over the decode steps so far (1.0 before any)."""
        return self.stats["decode_rows"] / self.stats["slot_steps"] if self.stats["slot_steps"] else 1.0

    def state_dict(self) -> dict:
        """Everything in flight, on the CPU: the waiting requests, and each active sequence with its tokens, versions,
        random stream and its slot's cache entries (what `load_state_dict` restores)."""
        cache = self.cache
        active = []
        for slot, s in sorted(self.active.items()):
            active.append({"key": s.key, "request": _plain(s.request), "slot": slot, "tokens": list(s.tokens), "logprobs": list(s.logprobs),
                           "versions": s.versions, "generator": s.generator.get_state() if s.generator is not None else None,
                           "keys": [k[slot].cpu().clone() for k in cache.keys], "values": [v[slot].cpu().clone() for v in cache.values]})
        return {"version": self.version, "count": self._count, "waiting": [(k, _plain(r)) for k, r in self.waiting], "active": active,
                "slots": self.slots, "max_len": self.max_len}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s sequences in flight into this (empty) decoder of the same slots and max_len."""
        if self.pending:
            raise ValueError("load_state_dict needs an empty decoder")
        if (state["slots"], state["max_len"]) != (self.slots, self.max_len):
            raise ValueError(f"the saved decoder had {state['slots']} slots of {state['max_len']} positions; this one has "
                             f"{self.slots} of {self.max_len}")
        self.version, self._count = state["version"], state["count"]
        self.waiting = deque((k, Request(*r)) for k, r in state["waiting"])
        for a in state["active"]:
            slot, request = a["slot"], Request(*a["request"])
            gen = self.sampling.generator(request.seed)
            if gen is not None:
                gen.set_state(a["generator"])
            s = _Sequence(a["key"], request, slot, gen)
            s.tokens, s.logprobs, s.versions = list(a["tokens"]), list(a["logprobs"]), tuple(a["versions"])
            for k, saved in zip(self.cache.keys, a["keys"]):
                k[slot].copy_(saved)
            for v, saved in zip(self.cache.values, a["values"]):
                v[slot].copy_(saved)
            self.active[slot] = s
            self.free.remove(slot)
        heapq.heapify(self.free)


def _plain(r: Request) -> tuple:
    """A request as plain data (a saved state loads with `torch.load(weights_only=True)`)."""
    return list(r.prompt), r.max_new_tokens, list(r.stop), r.seed


@torch.no_grad()
def generate(model: OLMo, requests: Sequence[Request], *, batch_size: int = 8, sampling: Sampling = Sampling(),
             stop_ids: Sequence[int] = (), tokenizer=None, cache_budget: int | None = None,
             prefill_tokens: int | None = None, cuda_graphs: bool | None = None,
             progress: Callable[[int, int, int], None] | None = None, attention: str = "auto",
             interrupt: Callable[[], bool] | None = None, compile: bool | None = None) -> Generation:
    """Complete every request (see the module docstring); completions come back in the requests' order.

    `stop_ids`: ids that end a sequence (the EOS, a chat model's turn end). `tokenizer`: needed for stop
    strings and `Completion.text`. `cache_budget`: bytes the KV cache may take (default: 80% of the GPU's
    free memory, or 4 GiB on CPU); a batch that cannot fit is refused, saying how many sequences would.
    `cuda_graphs` (default: on a GPU): decode steps replay CUDA graphs (`graphs.DecodeGraphs`). `compile` (default: on
    a GPU): the decode step's arithmetic runs compiled (`compiled.CompiledStep`).
    `progress(finished, total, new_tokens)` is called after every forward. `attention`: the decode step's kernel
    (`olmo_ds.model.decode.attention`: auto, sdpa or triton). `interrupt()` is asked before every forward: True
    stops the generation with `GenerationInterrupted` (a training run's stop request during an RL rollout)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    check_requests(requests, model.cfg, has_tokenizer=tokenizer is not None)
    start = time.perf_counter()
    decoder = Decoder(model, slots=min(batch_size, len(requests)), max_len=max(len(r.prompt) + r.max_new_tokens for r in requests),
                      sampling=sampling, stop_ids=stop_ids, tokenizer=tokenizer, cache_budget=cache_budget,
                      prefill_tokens=prefill_tokens, cuda_graphs=cuda_graphs, attention=attention, compile=compile)
    decoder.submit(requests)
    done = dict(decoder.run(interrupt=interrupt, progress=progress))
    seconds = time.perf_counter() - start
    stats = {k: v for k, v in decoder.stats.items() if k != "slot_steps"}
    graphs = decoder.graphs
    stats.update(requests=len(requests), batch_size=decoder.slots, attention=decoder.cache.kernel,
                 compiled=decoder.step is not None and decoder.step.enabled, varlen_prefill=decoder.cache.varlen is True,
                 graph_forwards=graphs.replays if graphs is not None else 0, max_len=decoder.max_len,
                 cache_bytes_per_sequence=decoder.per_sequence, cache_bytes=decoder.per_sequence * decoder.slots, seconds=seconds,
                 new_tokens_per_second=stats["new_tokens"] / max(seconds, 1e-9), occupancy=decoder.occupancy())
    return Generation([done[n] for n in range(len(requests))], stats)
