"""Batched generation (olmo_ds/model/decode/): greedy outputs are transformers' `generate` tokens at any batch
size, sampling is reproducible per prompt, sequences stop where they should and leave the batch, and bad
requests are refused before any forward."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.decode import Request, Sampling, SlotCache, bytes_per_sequence, generate, next_tokens, token_logprobs
from olmo_ds.tokenizer import load_tokenizer

from model_testlib import OLMO2_TINY, OLMO3_TINY, hf_model_from, random_model
from testdata import SHARED

LENGTHS = [3, 17, 9, 1, 30, 12, 5, 22, 8, 2]  # 10 prompts: a batch of 8 refills two freed slots
LIMITS = [20, 12, 25, 7, 20, 20, 3, 16, 20, 11]


def mixed_requests(vocab: int, seed: int = 1) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, vocab, (n,), generator=g).tolist(), m) for n, m in zip(LENGTHS, LIMITS)]


@pytest.mark.parametrize("base", [OLMO2_TINY, OLMO3_TINY], ids=["olmo2", "olmo3"])
def test_greedy_is_transformers_generate_at_batch_1_and_8(base):
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(**dict(base, vocab_size=384, max_seq_len=128))  # OLMo 3: window 6 < prompt + output
    model = random_model(cfg, seed=3)
    requests = mixed_requests(cfg.vocab_size)
    one, eight = (generate(model, requests, batch_size=b).completions for b in (1, 8))
    assert [c.tokens for c in one] == [c.tokens for c in eight]
    assert all(c.finish == "length" and len(c.tokens) == r.max_new_tokens for c, r in zip(eight, requests))
    hf = hf_model_from(model)
    config = transformers.GenerationConfig(pad_token_id=0, eos_token_id=None, do_sample=False)
    for r, c in zip(requests, eight):
        expected = hf.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, generation_config=config)
        assert c.tokens == expected[0, len(r.prompt):].tolist()


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # the interpreter's -inf - -inf, masked
# OLMo 3 (windows as rings, and full layers) every run; OLMo 2 (full layers only) in the slow tier
@pytest.mark.parametrize("base", [pytest.param(OLMO2_TINY, marks=pytest.mark.slow, id="olmo2"), pytest.param(OLMO3_TINY, id="olmo3")])
def test_triton_decode_kernel_reads_each_slots_own_length_and_decodes_the_sdpa_tokens(base):
    """The GPU's decode attention (`attention.triton_decode`: split-K over each slot's own length, slots read by
    index, windows as rings), run in Triton's CPU interpreter in fp32: the tokens of the SDPA path at batch 1 and
    3 (5 prompts: freed slots are refilled, so tail steps read non-contiguous slots), and outputs within float32
    rounding of a float64 reference when chunks split a span (GQA: two query heads per kv head)."""
    import os
    import subprocess
    import sys

    from olmo_ds.model.decode import triton_decode

    if not triton_decode.AVAILABLE:
        pytest.skip("needs the triton package (its CPU interpreter runs the kernel here)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _check_triton_decode(base)
        return
    # Triton picks compiled or interpreted when a kernel is defined (at import): run this test again in a process
    # that imports it under the interpreter.
    test = f"{__file__}::test_triton_decode_kernel_reads_each_slots_own_length_and_decodes_the_sdpa_tokens[{base is OLMO2_TINY and 'olmo2' or 'olmo3'}]"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def _check_triton_decode(base) -> None:
    import math

    from olmo_ds.model.decode import attention

    g = torch.Generator().manual_seed(5)
    q, keys, values = torch.randn(3, 4, 16, generator=g), torch.randn(5, 2, 200, 16, generator=g), torch.randn(5, 2, 200, 16, generator=g)
    slots, lengths = torch.tensor([4, 0, 2]), torch.tensor([192, 1, 77], dtype=torch.int32)
    assert attention.splits_for(3, 2, 192)[0] == 3  # three chunks of 64: the combine merges them
    out = attention.triton_decode(q, keys, values, slots, lengths, 0.25, 192).double()
    for a in range(3):
        k, v = (t[slots[a], :, :lengths[a]].double().repeat_interleave(2, 0) for t in (keys, values))
        ref = torch.softmax((q[a].double()[:, None, :] * k).sum(-1) * 0.25, -1)[..., None].mul(v).sum(1)
        assert (out[a] - ref).norm() / ref.norm() < 1e-6
    cfg = ModelConfig(**dict(base, vocab_size=384, max_seq_len=128))
    model = random_model(cfg, seed=3)
    requests = mixed_requests(cfg.vocab_size)[:5]
    for b in (1, 3):  # 3 slots for 5 prompts: freed slots are refilled, so tail steps read slots out of order
        sdpa, fast = (generate(model, requests, batch_size=b, attention=k) for k in ("sdpa", "triton"))
        assert (sdpa.stats["attention"], fast.stats["attention"]) == ("sdpa", "triton")  # the kernel ran, no fallback
        assert [c.tokens for c in fast.completions] == [c.tokens for c in sdpa.completions]
    with pytest.raises(ValueError, match="decode attention must be one of auto, sdpa, triton, got 'flash'"):
        generate(model, requests, attention="flash")
    assert math.isfinite(out.sum())


def test_sliding_layers_keep_a_window_sized_ring_and_memory_per_sequence_counts_it():
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384))
    cache = SlotCache(cfg, slots=3, max_len=50, device="cpu", dtype=torch.float32)
    lengths = [k.shape[2] for k in cache.keys]
    assert lengths == [6 if cfg.layer_is_sliding(i) else 50 for i in range(cfg.n_layers)] and 6 in lengths and 50 in lengths
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert bytes_per_sequence(cfg, 50, torch.float32) == per_position * sum(lengths)
    assert bytes_per_sequence(cfg, 50, torch.bfloat16) * 2 == bytes_per_sequence(cfg, 50, torch.float32)
    stats = generate(random_model(cfg), mixed_requests(384)[:2], batch_size=2).stats
    assert stats["cache_bytes_per_sequence"] == bytes_per_sequence(cfg, stats["max_len"], torch.float32)


def test_finished_sequences_leave_the_batch():
    model = random_model(ModelConfig(**dict(OLMO3_TINY, vocab_size=384)))
    requests = [Request([1, 2, 3], 2), Request([4, 5], 20), Request([6], 5)]
    stats = generate(model, requests, batch_size=2).stats
    # Each sequence is in exactly (max_new_tokens - 1) decode forwards; the third takes the first's slot.
    assert stats["decode_rows"] == sum(r.max_new_tokens - 1 for r in requests)
    assert stats["new_tokens"] == sum(r.max_new_tokens for r in requests)
    # The cache entries the decode steps' attention must read: a step at position p reads p + 1 in a full layer, at most
    # the window (6) in a sliding one (bench_generate's bytes bound)
    cfg = model.cfg
    sliding = sum(cfg.layer_is_sliding(i) for i in range(cfg.n_layers))
    assert 0 < sliding < cfg.n_layers
    assert stats["decode_cache_reads"] == sum((cfg.n_layers - sliding) * n + sliding * min(n, 6) for r in requests
                                              for n in range(len(r.prompt) + 1, len(r.prompt) + r.max_new_tokens))


def test_sampling_is_seeded_per_prompt_whatever_the_batch_size():
    model = random_model(ModelConfig(**dict(OLMO3_TINY, vocab_size=384)), seed=2)
    requests = mixed_requests(384, seed=4)
    sampling = Sampling(temperature=0.9, top_p=0.9, top_k=40, seed=7)
    runs = [[c.tokens for c in generate(model, requests, batch_size=b, sampling=sampling).completions] for b in (1, 3, 8)]
    assert runs[0] == runs[1] == runs[2]
    other = [c.tokens for c in generate(model, requests, batch_size=8, sampling=Sampling(temperature=0.9, seed=8)).completions]
    assert other != runs[0]
    greedy = [c.tokens for c in generate(model, requests, batch_size=8).completions]
    assert greedy != runs[0]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, seed=3), Sampling(temperature=1.3, top_k=50, top_p=0.9, seed=4)],
                         ids=["greedy", "temperature", "top-k-top-p"])
def test_completion_logprobs_are_a_full_forwards_under_the_sampling_distribution(sampling):
    """Each generated token's log-probability equals a full forward of prompt + completion with the sampling's
    temperature, top-k and top-p applied and renormalised (fp32, 1e-5), at batch 1 and 8 alike."""
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384, max_seq_len=128))
    model = random_model(cfg, seed=6).eval()
    requests = mixed_requests(cfg.vocab_size, seed=9)
    one, eight = (generate(model, requests, batch_size=b, sampling=sampling).completions for b in (1, 8))
    for r, a, b in zip(requests, one, eight):
        assert a.tokens == b.tokens and len(b.logprobs) == len(b.tokens)
        ids = torch.tensor([list(r.prompt) + b.tokens])
        with torch.no_grad():
            logits = model(ids)[0, len(r.prompt) - 1:-1]
        expected = token_logprobs(logits, torch.tensor(b.tokens), cfg.vocab_size, sampling)
        assert torch.allclose(torch.tensor(b.logprobs), expected, atol=1e-5, rtol=0)
        assert torch.allclose(torch.tensor(a.logprobs), expected, atol=1e-5, rtol=0)
        assert all(lp <= 0 for lp in b.logprobs)
    if not sampling.greedy:  # the distribution drawn from, not the model's: temperature changes every log-probability
        with torch.no_grad():
            raw = torch.log_softmax(model(torch.tensor([list(requests[0].prompt) + eight[0].tokens]))[0, len(requests[0].prompt) - 1:-1, :384], -1)
        assert not torch.allclose(raw.gather(-1, torch.tensor(eight[0].tokens)[:, None]).squeeze(-1), torch.tensor(eight[0].logprobs), atol=1e-3)


def test_a_requests_own_seed_draws_the_same_tokens_wherever_it_sits():
    model = random_model(ModelConfig(**dict(OLMO3_TINY, vocab_size=384)), seed=2)
    base = mixed_requests(384, seed=4)
    keyed = [Request(r.prompt, r.max_new_tokens, seed=1000 + n) for n, r in enumerate(base)]
    sampling = Sampling(temperature=1.0, seed=5)
    forward = [c.tokens for c in generate(model, keyed, batch_size=3, sampling=sampling).completions]
    backward = [c.tokens for c in generate(model, keyed[::-1], batch_size=8, sampling=sampling).completions][::-1]
    assert forward == backward
    by_index = [c.tokens for c in generate(model, base, batch_size=3, sampling=sampling).completions]
    assert by_index != forward  # the key, not the place in the list, seeds the sample
    with pytest.raises(ValueError, match=r"prompt 0: seed must be an integer in \[0, 2\*\*32\)"):
        generate(model, [Request([1, 2], 3, seed=-1)], sampling=sampling)


def test_top_k_and_top_p_sample_only_inside_their_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    draws = lambda s: {int(t) for _ in range(100) for t in next_tokens(logits, 4, s, gens)[0]}  # noqa: E731
    assert draws(Sampling(temperature=1.0, top_p=0.75)) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert draws(Sampling(temperature=1.0, top_k=3)) == {0, 1, 2}
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(Sampling(temperature=1.0, top_p=1e-6)) == {0}
    padded = torch.cat([logits, torch.full((4, 2), 100.0)], dim=1)  # padded vocabulary rows are never chosen
    assert {int(t) for t in next_tokens(padded, 4, Sampling(), [None] * 4)[0]} == {0}


def test_eos_stop_ids_stop_strings_and_limits_end_each_sequence():
    tok = load_tokenizer(SHARED / "tokenizers" / "dolma2-tokenizer.json")
    model = random_model(ModelConfig(**dict(OLMO3_TINY, vocab_size=100352)), seed=5)
    prompt = tok.encode("Once upon a time")
    free = generate(model, [Request(prompt, 24)], tokenizer=tok).completions[0]
    assert free.finish == "length" and free.text == tok.decode(free.tokens)
    stop_id = free.tokens[6]
    ended = generate(model, [Request(prompt, 24)], stop_ids=[stop_id], tokenizer=tok).completions[0]
    first = free.tokens.index(stop_id)
    assert ended.finish == "eos" and ended.tokens == free.tokens[:first + 1] and ended.text == tok.decode(free.tokens[:first])
    # A stop string made of the text of tokens 8-10: the sequence ends once its text holds it, cut before it.
    stop = tok.decode(free.tokens[8:11]).strip() or tok.decode(free.tokens[8:11])
    cut = generate(model, [Request(prompt, 24, (stop, "never appears \u2603"))], tokenizer=tok).completions[0]
    assert cut.finish == "stop" and len(cut.tokens) <= 11 and stop in tok.decode(cut.tokens)
    assert cut.text == tok.decode(cut.tokens)[:tok.decode(cut.tokens).find(stop)] and stop not in cut.text


def test_refusals_before_any_forward():
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384))
    model = random_model(cfg)
    with pytest.raises(ValueError, match="prompt 1: the prompt has 128 tokens and the model's context is 128, which leaves no room for a new token; "
                       "shorten the prompt to at most 127 tokens"):
        generate(model, [Request([1], 2), Request([1] * 128, 1)])
    with pytest.raises(ValueError, match="prompt 0: 100 tokens \\+ max_new_tokens 50 exceed the model's context of 128; lower max_new_tokens to 28"):
        generate(model, [Request([1] * 100, 50)])
    with pytest.raises(ValueError, match="stop strings must be non-empty strings, got ''"):
        generate(model, [Request([1], 2, ("",))], tokenizer=object())
    with pytest.raises(ValueError, match="outside the model's vocabulary of 384"):
        generate(model, [Request([384], 2)])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(model, [Request([1], 0)])
    with pytest.raises(ValueError, match="cuda_graphs needs the model on a CUDA device, not cpu"):
        generate(model, [Request([1], 2)], cuda_graphs=True)
    with pytest.raises(ValueError, match="compile \\(the compiled decode step\\) needs the model on a CUDA device, not cpu"):
        generate(model, [Request([1], 2)], compile=True)
    per_seq = bytes_per_sequence(cfg, 60, torch.float32)
    with pytest.raises(ValueError, match=r"a batch of 8 sequences of up to 60 tokens needs .* at most 3 sequences fit; lower the batch size to 3"):
        generate(model, [Request([1] * 10, 50)] * 8, batch_size=8, cache_budget=3 * per_seq + 1)
    for bad, match in [(dict(temperature=-1), "temperature must be >= 0"), (dict(top_p=0), "top_p must be in"),
                       (dict(top_p=1.5), "top_p must be in"), (dict(top_k=-2), "top_k must be an integer"),
                       (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=match):
            Sampling(**bad)


def test_the_gpu_cache_budget_counts_what_pytorch_holds_unused(monkeypatch):
    """On a GPU the cache's budget is 80% of the device's free memory plus what PyTorch's caching allocator reserved
    and does not use (a training step's freed activations: RL decodes right after an update), not of the free memory
    alone, which refused a rollout's batch that fitted (bench_rl on an H100, 2026-12-07). The device's figures here
    are set: this checks the arithmetic, not a GPU."""
    from olmo_ds.model.decode import cache

    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 30 * gib)
    budget, source = cache.cache_budget(torch.device("cuda", 0))
    assert budget == int(30 * gib * cache.GPU_SHARE) and "what PyTorch holds unused" in source
    cfg = ModelConfig(**dict(OLMO2_TINY, max_seq_len=1280))
    per_seq = bytes_per_sequence(cfg, 1280, torch.bfloat16)
    assert cache.sequences_that_fit(cfg, 1280, torch.bfloat16, torch.device("cuda", 0)) == int(30 * gib * cache.GPU_SHARE) // per_seq


def test_generate_script_writes_a_prompts_file_as_json_lines(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from olmo_ds.weights import save_model_dir

    root = Path(__file__).resolve().parents[2]
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=100278))
    model = random_model(cfg)
    save_model_dir(tmp_path / "m", cfg, model.state_dict())
    tokenizer_path = SHARED / "tokenizers" / "dolma2-tokenizer.json"
    (tmp_path / "m" / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    prompts = tmp_path / "prompts.jsonl"
    records = [{"prompt": "Once upon a time", "id": "a"}, {"prompt": "The capital of France is", "max_new_tokens": 3},
               {"prompt": "1, 2, 3,", "stop": ["\n"]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    script = [sys.executable, "scripts/generate.py", str(tmp_path / "m")]
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([*script, "--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "6", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "generate: 3/3 prompts" in proc.stderr and "KiB per sequence" in proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tok = load_tokenizer(tokenizer_path)
    expected = generate(model, [Request(tok.encode(r["prompt"]), r.get("max_new_tokens", 6), tuple(r.get("stop", []))) for r in records],
                        stop_ids=[tok.eos_id], tokenizer=tok).completions
    assert lines == [{**({"id": "a"} if n == 0 else {}), "prompt": r["prompt"], "completion": c.text, "tokens": len(c.tokens),
                      "finish": c.finish} for n, (r, c) in enumerate(zip(records, expected))]
    again = subprocess.run([*script, "--prompts", str(prompts), "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert again.returncode == 2 and "exists; completions are never written over a file" in again.stderr
    prompts.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    bad = subprocess.run([*script, "--prompts", str(prompts)], capture_output=True, text=True, timeout=300, cwd=root)
    assert bad.returncode == 2 and f"{prompts}:2: a \"messages\" record needs a chat template: pass --chat" in bad.stderr
    bad = subprocess.run([*script, "--prompt", "x", "--top-p", "0"], capture_output=True, text=True, timeout=300, cwd=root)
    assert bad.returncode == 2 and "top_p must be in (0, 1], got 0.0" in bad.stderr
    long = subprocess.run([*script, "--prompt", "word " * 200], capture_output=True, text=True, timeout=300, cwd=root)
    assert long.returncode == 2 and "the prompt has 201 tokens and the model's context is 128, which leaves no room for a new " \
        "token; shorten the prompt to at most 127 tokens" in long.stderr, long.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_decode_what_eager_steps_decode(dtype):
    """GPU tier: every decode step replays a CUDA graph (one per row bucket and span bucket; these prompts cross a span
    bucket, and the tail runs 2 and 1 sequences) and gives the eager steps' tokens."""
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384, max_seq_len=600))
    model = random_model(cfg, seed=3).to(device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(2)
    requests = [Request(torch.randint(0, 384, (n,), generator=g).tolist(), m)
                for n, m in zip([300, 20, 270, 5, 40, 260, 8, 100, 3, 250], [30, 12, 25, 40, 30, 20, 3, 16, 30, 11])]
    eager = generate(model, requests, batch_size=4, cuda_graphs=False)
    graphed = generate(model, requests, batch_size=4)
    # Every step replays a graph, the tail's too (its rows padded to a bucket: 4, 2, 1 sequences)
    assert eager.stats["graph_forwards"] == 0 and graphed.stats["graph_forwards"] == graphed.stats["decode_forwards"] > 0
    assert [c.tokens for c in graphed.completions] == [c.tokens for c in eager.completions]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_decode_on_the_gpu_matches_sdpa():
    """GPU tier: the default decode kernel on a GPU (triton) decodes the SDPA path's tokens in fp32 (graphs on, OLMo 3
    windows), and in bf16 its attention is within bf16 rounding of SDPA's over the same entries."""
    pytest.importorskip("triton")
    from olmo_ds.model.decode import attention

    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384, max_seq_len=600))
    model = random_model(cfg, seed=3).to(device="cuda")
    g = torch.Generator().manual_seed(2)
    requests = [Request(torch.randint(0, 384, (n,), generator=g).tolist(), m)
                for n, m in zip([300, 20, 270, 5, 40, 260, 8, 100, 3, 250], [30, 12, 25, 40, 30, 20, 3, 16, 30, 11])]
    sdpa, fast = (generate(model, requests, batch_size=4, attention=k) for k in ("sdpa", "triton"))
    assert fast.stats["graph_forwards"] > 0 and fast.stats["attention"] == "triton"  # the kernel ran, no fallback
    assert [c.tokens for c in fast.completions] == [c.tokens for c in sdpa.completions]
    # Pipelined graph steps (the host reads step k while step k+1 runs): sequences ending at a stop id one step
    # before the others, and sampled ones, decode what eager steps decode, at any batch size.
    stop = [fast.completions[0].tokens[5], fast.completions[2].tokens[3]]
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=4)):
        eager = generate(model, requests, batch_size=4, sampling=sampling, stop_ids=stop, cuda_graphs=False)
        for b in (1, 4):
            graphed = generate(model, requests, batch_size=b, sampling=sampling, stop_ids=stop)
            assert graphed.stats["graph_forwards"] > 0
            assert [c.tokens for c in graphed.completions] == [c.tokens for c in eager.completions]
            assert [c.finish for c in graphed.completions] == [c.finish for c in eager.completions]
        if sampling.greedy:  # the stop ids are greedy tokens: there some sequences end one step before the others
            assert "eos" in {c.finish for c in eager.completions}
    q = torch.randn(64, 16, 128, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(80, 16, 1280, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(80, device="cuda")[:64]
    lengths = torch.randint(1, 1281, (64,), device="cuda", dtype=torch.int32)
    out = attention.triton_decode(q, keys, values, slots, lengths, 128 ** -0.5, 1280).float()
    mask = (torch.arange(1280, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), keys[slots].float(), values[slots].float(),
                                                           attn_mask=mask, scale=128 ** -0.5)[:, :, 0]
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2



@pytest.mark.parametrize("base", [OLMO2_TINY, OLMO3_TINY], ids=["olmo2", "olmo3"])
def test_on_cpu_a_samples_numbers_do_not_depend_on_its_batch(base):
    """On CPU a sample's tokens and log-probabilities are the same bits whatever shares its batch (RL's 1 rank = 2
    ranks: each rank decodes a different mix of the same samples). A near-uniform distribution over a large
    vocabulary (a random model at temperature 1) turns any rounding difference into another token, so the test
    compares bits, not tolerances."""
    cfg = ModelConfig(**dict(base, vocab_size=4096, max_seq_len=96))
    model = random_model(cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (13, 2, 29, 7)]
    requests = [Request(p, 24 + 7 * i, seed=100 * i + j) for i, p in enumerate(prompts) for j in range(5)]
    sampling = Sampling(temperature=1.0, seed=1)

    def run(subset, batch_size):
        done = generate(model, [requests[k] for k in subset], batch_size=batch_size, sampling=sampling).completions
        return {k: (c.tokens, c.logprobs) for k, c in zip(subset, done)}

    everything = run(range(20), 20)
    for subset, batch_size in [(range(10), 10), (range(10, 20), 4), (range(19, -1, -1), 7), ([3], 1), ([17, 2, 9], 2)]:
        mine = run(subset, batch_size)
        assert mine == {k: everything[k] for k in subset}, (list(subset), batch_size)
