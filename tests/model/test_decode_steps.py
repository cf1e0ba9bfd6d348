"""The decode engine's GPU shapes, checked where they can be on CPU: a prefill wave as one variable-length attention
forward writes the cache the per-prompt path writes, decode rows padded to a bucket write only the scratch slot, and
on a GPU (`-m gpu`) the compiled step and the flash prefill are the eager ones up to rounding."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.decode import Request, generate
from olmo_ds.model.decode import cache as cache_mod
from olmo_ds.model.decode.cache import SlotCache, row_bucket
from olmo_ds.model.decode.forward import forward_logits

from model_testlib import OLMO3_TINY, random_model

CFG = ModelConfig(**dict(OLMO3_TINY, vocab_size=384, max_seq_len=128))  # windows of 6: rings, prompts longer than them
PROMPTS = {3: [5, 17, 9, 30, 2, 11, 40, 8], 0: [1, 2, 3], 5: [7] * 14, 1: [9, 8, 7, 6, 5, 4, 3]}  # slot -> prompt


def test_row_buckets_are_powers_of_two_up_to_the_slots():
    assert [row_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert [row_bucket(n, 48) for n in (17, 33, 48)] == [32, 48, 48]


def reference_varlen(q, k, v, cu, longest, window, scale):
    """Each sequence's causal (windowed) attention in float64, straight from the definition."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[a:b].double(), k[a:b].double().repeat_interleave(rep, 1), v[a:b].double().repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        pos = torch.arange(b - a)
        allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), vs).to(q.dtype)
    return out


def prefilled(model, wave: bool, monkeypatch) -> tuple[SlotCache, torch.Tensor]:
    cache = SlotCache(CFG, slots=6, max_len=40, device="cpu", dtype=torch.float32, scratch=True)
    if wave:  # the GPU's path: one forward over the row with the kernel's definition in its place, vectorised writes
        monkeypatch.setattr(cache_mod, "varlen_attention", reference_varlen)
        cache.varlen = None
    slots, prompts = list(PROMPTS), list(PROMPTS.values())
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([[t for p in prompts for t in p]])
    positions = torch.tensor([[i for n in lengths for i in range(n)]])
    cache.prefill(slots, lengths)
    with torch.no_grad():
        logits = forward_logits(model, ids, positions, cache, torch.tensor(lengths).cumsum(0) - 1)
    assert cache.varlen is wave
    return cache, logits


def test_a_prefill_wave_as_one_varlen_forward_writes_what_the_per_prompt_path_writes(monkeypatch):
    """The wave's index (cumulative lengths, each token's slot and position, the positions a ring keeps) and its
    one-copy cache writes: the same keys and values in the same slots, positions and ring places as one SDPA call
    and one write per prompt, and the same logits to float32 rounding (the kernel here is the definition in
    float64); prompts longer than the window fill their rings with their last 6 positions."""
    model = random_model(CFG, seed=4)
    (each, each_logits), (wave, wave_logits) = prefilled(model, False, monkeypatch), prefilled(model, True, monkeypatch)
    assert torch.allclose(wave_logits, each_logits, atol=1e-5, rtol=0)
    for layer, (k1, k2, v1, v2) in enumerate(zip(each.keys, wave.keys, each.values, wave.values)):
        assert torch.allclose(k1, k2, atol=1e-5, rtol=0) and torch.allclose(v1, v2, atol=1e-5, rtol=0), layer
        written = (k2.abs().sum((1, 3)) > 0)  # [slots + 1, positions]
        for slot in range(7):
            n = len(PROMPTS.get(slot, []))
            expected = min(n, k2.shape[2])
            assert int(written[slot].sum()) == expected, (layer, slot)


def test_padding_rows_of_a_bucket_write_the_scratch_slot_only():
    """A decode step of 3 sequences padded to a bucket of 4 rows (token 0 at position 0 of the scratch slot): every
    live slot's keys and values and the 3 sequences' logits are those of the unpadded step (to float32 rounding: a
    matmul of 4 rows may round as one of 3 does not), and the scratch slot holds the padding row's key at position 0
    and nothing else."""
    model = random_model(CFG, seed=4)
    runs = []
    for padded in (False, True):
        cache, _ = prefilled(model, False, None)
        rows = [(11, 8, 3), (12, 3, 0), (13, 14, 5)] + ([(0, 0, cache.scratch)] if padded else [])
        slots = torch.tensor([s for _, _, s in rows])
        positions = torch.tensor([p for _, p, _ in rows])
        cache.decode(slots, positions, 256, contiguous=False, host=[(s, p) for _, p, s in rows])
        with torch.no_grad():
            logits = forward_logits(model, torch.tensor([[t] for t, _, _ in rows]), positions[:, None], cache, torch.arange(len(rows)))
        runs.append((cache, logits[:3]))
    (plain, plain_logits), (padded, padded_logits) = runs
    assert torch.allclose(plain_logits, padded_logits, atol=1e-5, rtol=0)
    for k1, k2 in zip(plain.keys + plain.values, padded.keys + padded.values):
        assert torch.allclose(k1[:6], k2[:6], atol=1e-5, rtol=0) and torch.equal(k1[:6] == 0, k2[:6] == 0)
        assert k1[6].abs().sum() == 0 and k2[6][:, 0].abs().sum() > 0 and k2[6][:, 1:].abs().sum() == 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_flash_varlen_prefill_matches_the_per_prompt_prefill_on_the_gpu(monkeypatch):
    """GPU tier: in bf16 the variable-length flash prefill (one forward for the wave, windows as the kernel's) writes
    the per-prompt SDPA path's keys and values and logits within bf16 rounding."""
    model = random_model(CFG, seed=4).to(device="cuda", dtype=torch.bfloat16)
    slots, prompts = list(PROMPTS), list(PROMPTS.values())
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([[t for p in prompts for t in p]], device="cuda")
    positions = torch.tensor([[i for n in lengths for i in range(n)]], device="cuda")
    out = []
    for varlen in (None, False):
        cache = SlotCache(CFG, slots=6, max_len=40, device="cuda", dtype=torch.bfloat16, scratch=True)
        cache.varlen = varlen
        cache.prefill(slots, lengths)
        with torch.no_grad():
            out.append((cache, forward_logits(model, ids, positions, cache, torch.tensor(lengths, device="cuda").cumsum(0) - 1).float()))
    (wave, wave_logits), (each, each_logits) = out
    assert wave.varlen is True and each.varlen is False
    assert ((wave_logits - each_logits).norm() / each_logits.norm()).item() < 2e-2
    for k1, k2 in zip(wave.keys + wave.values, each.keys + each.values):
        assert ((k1.float() - k2.float()).norm() / k2.float().norm().clamp(min=1e-6)).item() < 2e-2


@pytest.mark.gpu
@cuda
def test_the_compiled_step_is_the_eager_step_up_to_rounding():
    """GPU tier: the compiled decode step (`decode.compiled`) gives the eager forward's logits within float32 rounding
    at 3 and 1 rows, and generation with it decodes the eager step's greedy tokens, graphs on and off."""
    from olmo_ds.model.decode.compiled import CompiledStep

    model = random_model(CFG, seed=4).to(device="cuda")
    step = CompiledStep(model)
    cache = SlotCache(CFG, slots=6, max_len=40, device="cuda", dtype=torch.float32, scratch=True)
    for t in cache.keys + cache.values:
        t.normal_()
    for rows in ([(11, 8, 3), (12, 3, 0), (13, 14, 5)], [(7, 20, 1)]):
        slots = torch.tensor([s for _, _, s in rows], device="cuda")
        positions = torch.tensor([p for _, p, _ in rows], device="cuda")
        ids = torch.tensor([[t] for t, _, _ in rows], device="cuda")
        logits = []
        for s in (None, step):
            cache.decode(slots, positions, 256, contiguous=False)
            with torch.no_grad():
                logits.append(forward_logits(model, ids, positions[:, None], cache, torch.arange(len(rows), device="cuda"), s))
        assert step.enabled and torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    g = torch.Generator().manual_seed(2)
    requests = [Request(torch.randint(0, 384, (n,), generator=g).tolist(), m) for n, m in zip([30, 2, 27, 5, 40], [30, 12, 25, 40, 3])]
    plain = generate(model, requests, batch_size=4, compile=False, cuda_graphs=False)
    for graphs in (False, True):
        fast = generate(model, requests, batch_size=4, cuda_graphs=graphs)
        assert fast.stats["compiled"] and not plain.stats["compiled"]
        assert [c.tokens for c in fast.completions] == [c.tokens for c in plain.completions]


def test_a_flash_prefill_that_cannot_run_falls_back_to_the_per_prompt_path(capfd):
    """Where the variable-length flash kernel fails on its first call (here: it has no CPU kernel), the wave is
    prefilled a prompt at a time, with the same numbers, after one line on stderr; later waves do not try again."""
    model = random_model(CFG, seed=4)
    plain, plain_logits = prefilled(model, False, None)
    cache = SlotCache(CFG, slots=6, max_len=40, device="cpu", dtype=torch.float32, scratch=True)
    cache.varlen = None  # as on a GPU in bf16: try the flash kernel first
    lengths = [len(p) for p in PROMPTS.values()]
    for _ in range(2):
        cache.prefill(list(PROMPTS), lengths)
        with torch.no_grad():
            tried_logits = forward_logits(model, torch.tensor([[t for p in PROMPTS.values() for t in p]]),
                                          torch.tensor([[i for n in lengths for i in range(n)]]), cache, torch.tensor(lengths).cumsum(0) - 1)
    assert cache.varlen is False and torch.equal(tried_logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, plain.keys + plain.values))
    err = capfd.readouterr().err
    assert err.count("the variable-length flash prefill failed") == 1 and "prefilling a prompt at a time" in err


def test_a_compiled_step_that_fails_on_its_first_call_falls_back_to_the_eager_step(monkeypatch, capfd):
    """A compiled decode step whose compile fails (injected here: a compiler error on the first call) turns itself off
    after one line on stderr, and the step's logits are the eager forward's; once it has run, a failure is an error."""
    from olmo_ds.model.decode import compiled

    model = random_model(CFG, seed=4)
    cache = SlotCache(CFG, slots=6, max_len=40, device="cpu", dtype=torch.float32, scratch=True)
    step = compiled.CompiledStep(model)

    def broken():
        raise RuntimeError("inductor: no C++ compiler found")

    monkeypatch.setattr(compiled, "_compiled", broken)
    rows = torch.tensor([3, 0]), torch.tensor([4, 2]), torch.tensor([[5], [6]])
    out = []
    for s in (step, None):
        cache.decode(rows[0], rows[1], 256, contiguous=False, host=list(zip(rows[0].tolist(), rows[1].tolist())))
        with torch.no_grad():
            out.append(forward_logits(model, rows[2], rows[1][:, None], cache, torch.arange(2), s))
    assert not step.enabled and torch.equal(out[0], out[1])
    assert step.forward(rows[2], rows[1][:, None], cache) is None
    assert capfd.readouterr().err.count("the compiled decode step failed (RuntimeError: inductor: no C++ compiler found)") == 1
    proven = compiled.CompiledStep(model)
    proven.proven = True
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        proven.forward(rows[2], rows[1][:, None], cache)


def test_the_compiled_step_multiplies_by_fused_weights_that_are_the_models_own(monkeypatch):
    """q/k/v and gate/up as one weight each (`compiled.fused`): the model's parameters become views of them, values
    unchanged; a write into a parameter in place (as `load_weights` and RL's `gather_into` do) is a write into the
    fused weight; a second step on the same model views the same memory. The step's arithmetic over the fused weights
    (its functions run uncompiled here) gives the eager forward's logits."""
    from olmo_ds.model.decode import compiled

    model = random_model(CFG, seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = compiled.CompiledStep(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    a, m = model.blocks[1].attn, model.blocks[1].mlp
    w_qkv, w_gate_up = step.weights[1]
    assert torch.equal(w_qkv, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert torch.equal(w_gate_up, torch.cat([m.gate_proj.weight, m.up_proj.weight]))
    with torch.no_grad():
        a.v_proj.weight.copy_(torch.full_like(a.v_proj.weight, 0.5))
    assert (w_qkv[-a.v_proj.weight.shape[0]:] == 0.5).all()
    model.load_state_dict(before)
    assert torch.equal(w_qkv[-a.v_proj.weight.shape[0]:], before["blocks.1.attn.v_proj.weight"])
    again = compiled.CompiledStep(model)
    assert all(x.data_ptr() == y.data_ptr() for pair, other in zip(step.weights, again.weights) for x, y in zip(pair, other))

    cache = SlotCache(CFG, slots=6, max_len=40, device="cpu", dtype=torch.float32, scratch=True)
    for t in cache.keys + cache.values:
        t.normal_()
    slots, positions, ids = torch.tensor([3, 0, 5]), torch.tensor([8, 3, 14]), torch.tensor([[11], [12], [13]])
    plain = {f.__name__: f for f in (compiled._qkv, compiled._rest, compiled._logits, compiled.rope_cos_sin)}
    monkeypatch.setattr(compiled, "_compiled", lambda: plain)
    out = []
    for s in (None, step):
        cache.decode(slots, positions, 256, contiguous=False, host=list(zip(slots.tolist(), positions.tolist())))
        with torch.no_grad():
            out.append(forward_logits(model, ids, positions[:, None], cache, torch.arange(3), s))
    assert step.enabled and torch.allclose(out[0], out[1], atol=1e-5, rtol=1e-5)

    # Parameters that are views of memory laid out by someone else (an optimizer's flat buffer: here v, k, q in that
    # order) stay where they are; the step joins them per call, to the same logits
    with torch.no_grad():
        for b in model.blocks:
            ps = [b.attn.v_proj.weight, b.attn.k_proj.weight, b.attn.q_proj.weight]
            flat, at = torch.cat([p.detach().clone() for p in ps]), 0
            for p in ps:
                p.data = flat[at:at + p.shape[0]]
                at += p.shape[0]
    where = [b.attn.q_proj.weight.data_ptr() for b in model.blocks]
    foreign = compiled.CompiledStep(model)
    assert all(w is None for w, _ in foreign.weights) and where == [b.attn.q_proj.weight.data_ptr() for b in model.blocks]
    cache.decode(slots, positions, 256, contiguous=False, host=list(zip(slots.tolist(), positions.tolist())))
    with torch.no_grad():
        assert torch.allclose(forward_logits(model, ids, positions[:, None], cache, torch.arange(3), foreign), out[0], atol=1e-5, rtol=1e-5)
