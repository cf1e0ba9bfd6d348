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
Everything a request could get wrong is refused before the first forward (`check_requests`).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from olmo_ds.model.decode.cache import SlotCache, check_fits, decode_span, padded_rows
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


@dataclass
class Completion:
    """`tokens`: the new ids (the EOS or stop id that ended it included). `finish`: eos, stop or length.
    `text` (with a tokenizer): the decoded reply without that id, cut before the first stop string.
    `logprobs[i]`: the float32 log-probability of `tokens[i]` under the distribution it was drawn from (temperature,
    top-k and top-p applied: `sampling.filtered_logits`; greedy: the model's own), what an RL importance ratio divides
    by. Not part of equality: two runs that decode the same tokens are the same completion."""

    tokens: list[int]
    finish: str
    text: str | None = None
    logprobs: list[float] = field(default_factory=list, compare=False)


class GenerationInterrupted(RuntimeError):
    """`generate`'s `interrupt()` asked it to stop; nothing it decoded is returned."""


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

    def __init__(self, index: int, request: Request, slot: int, generator):
        self.index, self.request, self.slot, self.generator = index, request, slot, generator
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        # Tokens whose decoded text can hold a whole stop string (a byte-level token may be one byte of a character).
        self.stop_window = 4 * max((len(s) for s in request.stop), default=0) + 4

    @property
    def position(self) -> int:
        """Where the next token (the last new one, not yet in the cache) goes."""
        return len(self.request.prompt) + len(self.tokens) - 1

    def add(self, token: int, logprob: float, stop_ids: frozenset[int], tokenizer) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in stop_ids:
            self.finish = "eos"
        elif self.request.stop and any(s in tokenizer.decode(self.tokens[-self.stop_window:]) for s in self.request.stop):
            self.finish = "stop"
        elif len(self.tokens) == self.request.max_new_tokens:
            self.finish = "length"


def _completion(seq: _Sequence, tokenizer) -> Completion:
    if tokenizer is None:
        return Completion(seq.tokens, seq.finish, logprobs=seq.logprobs)
    text = tokenizer.decode(seq.tokens[:-1] if seq.finish == "eos" else seq.tokens)
    cut = min((i for i in (text.find(s) for s in seq.request.stop) if i >= 0), default=len(text))
    return Completion(seq.tokens, seq.finish, text[:cut], seq.logprobs)


@torch.no_grad()
def generate(model: OLMo, requests: Sequence[Request], *, batch_size: int = 8, sampling: Sampling = Sampling(),
             stop_ids: Sequence[int] = (), tokenizer=None, cache_budget: int | None = None,
             prefill_tokens: int | None = None, cuda_graphs: bool | None = None,
             progress: Callable[[int, int, int], None] | None = None, attention: str = "auto",
             interrupt: Callable[[], bool] | None = None) -> Generation:
    """Complete every request (see the module docstring); completions come back in the requests' order.

    `stop_ids`: ids that end a sequence (the EOS, a chat model's turn end). `tokenizer`: needed for stop
    strings and `Completion.text`. `cache_budget`: bytes the KV cache may take (default: 80% of the GPU's
    free memory, or 4 GiB on CPU); a batch that cannot fit is refused, saying how many sequences would.
    `cuda_graphs` (default: on a GPU): steps with every slot busy replay CUDA graphs (`graphs.DecodeGraphs`).
    `progress(finished, total, new_tokens)` is called after every forward. `attention`: the decode step's kernel
    (`olmo_ds.model.decode.attention`: auto, sdpa or triton). `interrupt()` is asked before every forward: True
    stops the generation with `GenerationInterrupted` (a training run's stop request during an RL rollout)."""
    cfg = model.cfg
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    check_requests(requests, cfg, has_tokenizer=tokenizer is not None)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs needs the model on a CUDA device, not {device}")
    slots = min(batch_size, len(requests))
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    per_sequence = check_fits(cfg, slots, max_len, dtype, device, cache_budget)
    prefill_tokens = prefill_tokens or (32768 if device.type == "cuda" else 8192)
    stop_ids = frozenset(stop_ids)

    was_training = model.training
    model.eval()
    cache = SlotCache(cfg, slots, max_len, device, dtype, attention)
    graphs = DecodeGraphs(model, cache) if device.type == "cuda" and cuda_graphs is not False else None
    waiting = deque(range(len(requests)))
    free = list(range(slots))  # a heap: the lowest free slot first keeps the active ones contiguous
    active: dict[int, _Sequence] = {}
    done: list[_Sequence | None] = [None] * len(requests)
    stats = {"prefill_forwards": 0, "decode_forwards": 0, "decode_rows": 0, "prompt_tokens": 0, "new_tokens": 0,
             "prefill_seconds": 0.0, "decode_seconds": 0.0}
    start = time.perf_counter()

    def finish_or_keep(seqs: list[_Sequence], chosen: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Add each sequence's next token (sequences already finished skip theirs); whether any finished."""
        finished = False
        for seq, token, logprob in zip(seqs, chosen[0].tolist(), chosen[1].tolist()):
            if seq.finish:  # finished one step earlier (pipelined graph steps): this token was decoded past its end
                continue
            seq.add(token, logprob, stop_ids, tokenizer)
            stats["new_tokens"] += 1
            if seq.finish:
                finished = True
                done[seq.index] = seq
                del active[seq.slot]
                heapq.heappush(free, seq.slot)
        return finished

    pinned = device.type == "cuda"
    buffers = [(torch.empty(slots, dtype=torch.long, pin_memory=pinned), torch.empty(slots, dtype=torch.float32, pin_memory=pinned),
                torch.cuda.Event() if pinned else None) for _ in range(2)] if graphs is not None else []

    def graph_steps(seqs: list[_Sequence]) -> bool:
        """Decode steps of a full batch as graph replays, one step ahead of the host: step k+1 is launched with the
        tokens step k left on the device before the host reads step k's tokens back (through pinned buffers), so
        the GPU never waits for the host's bookkeeping. A step is launched only while no sequence can have reached
        its max_new_tokens, so no position passes the cache; once a sequence finishes, the step in flight is read
        (its tokens for the others are theirs, the finished one's is dropped) and the run returns. False when
        graphs are off (a capture failed): the caller steps eagerly."""
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=device)
        positions = torch.tensor([s.position for s in seqs], device=device)
        in_flight: list[tuple] = []
        launched = 0
        while True:
            if all(len(s.tokens) + len(in_flight) < s.request.max_new_tokens for s in seqs):
                span = decode_span(max(s.position for s in seqs) + len(in_flight) + 1, max_len)
                logits = graphs.logits(ids, positions, span)
                if logits is None:  # a capture failed and turned graphs off: read what is in flight, then step eagerly
                    for host_ids, host_logp, event in in_flight:
                        event.synchronize()
                        finish_or_keep(seqs, (host_ids, host_logp))
                    return launched > 0
                chosen = next_tokens(logits, cfg.vocab_size, sampling, [s.generator for s in seqs])
                host_ids, host_logp, event = buffers[launched % 2]
                host_ids.copy_(chosen[0], non_blocking=True)
                host_logp.copy_(chosen[1], non_blocking=True)
                event.record()
                in_flight.append((host_ids, host_logp, event))
                ids, positions = chosen[0][:, None], positions + 1
                launched += 1
                stats["decode_forwards"] += 1
                stats["decode_rows"] += len(seqs)
                if len(in_flight) < 2:
                    continue
            host_ids, host_logp, event = in_flight.pop(0)
            event.synchronize()
            if finish_or_keep(seqs, (host_ids, host_logp)):
                for host_ids, host_logp, event in in_flight:
                    event.synchronize()
                    finish_or_keep(seqs, (host_ids, host_logp))
                return True
            if progress is not None:
                progress(len(requests) - len(waiting) - len(active), len(requests), stats["new_tokens"])

    try:
        while waiting or active:
            if interrupt is not None and interrupt():
                raise GenerationInterrupted(f"generation stopped on request with {len(requests) - len(waiting) - len(active)} of "
                                            f"{len(requests)} sequences done")
            began = time.perf_counter()  # each branch ends reading its tokens back, so the host clock covers its GPU work
            if waiting and free:
                wave, total = [], 0
                while waiting and free and (not wave or total + len(requests[waiting[0]].prompt) <= prefill_tokens):
                    index = waiting.popleft()
                    wave.append(_Sequence(index, requests[index], heapq.heappop(free), sampling.generator(index if requests[index].seed is None else requests[index].seed)))
                    total += len(requests[index].prompt)
                lengths = [len(s.request.prompt) for s in wave]
                pad = padded_rows(total, cache.invariant) - total  # on CPU: padding positions, attended by nothing
                ids = torch.tensor([[t for s in wave for t in s.request.prompt] + [0] * pad], device=device)
                positions = torch.tensor([[p for n in lengths for p in range(n)] + [0] * pad], device=device)
                last = torch.tensor(lengths, device=device).cumsum(0) - 1
                last = torch.cat([last, last[-1:].expand(padded_rows(len(wave), cache.invariant) - len(wave))])
                cache.prefill([s.slot for s in wave], lengths, total + pad)
                logits = forward_logits(model, ids, positions, cache, last)[:len(wave)]
                for s in wave:
                    active[s.slot] = s
                finish_or_keep(wave, next_tokens(logits, cfg.vocab_size, sampling, [s.generator for s in wave]))
                stats["prefill_forwards"] += 1
                stats["prompt_tokens"] += total
                stats["prefill_seconds"] += time.perf_counter() - began
            elif active and graphs is not None and graphs.enabled and len(active) == slots and graph_steps(
                    [active[slot] for slot in sorted(active)]):
                stats["decode_seconds"] += time.perf_counter() - began
            elif active:
                seqs = [active[slot] for slot in sorted(active)]
                ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=device)
                positions = torch.tensor([s.position for s in seqs], device=device)
                span = decode_span(max(s.position for s in seqs) + 1, max_len)
                logits = graphs.logits(ids, positions, span) if graphs is not None and len(seqs) == slots else None
                if logits is None:  # on CPU the last sequence's row is repeated up to whole ROW_MULTIPLEs (`padded_rows`)
                    rows = seqs + seqs[-1:] * (padded_rows(len(seqs), cache.invariant) - len(seqs))
                    if len(rows) > len(seqs):
                        ids = torch.tensor([[s.tokens[-1]] for s in rows], device=device)
                        positions = torch.tensor([s.position for s in rows], device=device)
                    slot_ids = [s.slot for s in rows]
                    cache.decode(torch.tensor(slot_ids, device=device), positions, span, contiguous=slot_ids == list(range(len(rows))),
                                 host=[(s.slot, s.position) for s in rows] if cache.invariant else None)
                    logits = forward_logits(model, ids, positions[:, None], cache, torch.arange(len(rows), device=device))[:len(seqs)]
                finish_or_keep(seqs, next_tokens(logits, cfg.vocab_size, sampling, [s.generator for s in seqs]))
                stats["decode_forwards"] += 1
                stats["decode_rows"] += len(seqs)
                stats["decode_seconds"] += time.perf_counter() - began
            if progress is not None:
                progress(len(requests) - len(waiting) - len(active), len(requests), stats["new_tokens"])
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    stats.update(requests=len(requests), batch_size=slots, attention=cache.kernel, graph_forwards=graphs.replays if graphs is not None else 0,
                 max_len=max_len, cache_bytes_per_sequence=per_sequence,
                 cache_bytes=per_sequence * slots, seconds=seconds, new_tokens_per_second=stats["new_tokens"] / max(seconds, 1e-9))
    return Generation([_completion(s, tokenizer) for s in done], stats)
