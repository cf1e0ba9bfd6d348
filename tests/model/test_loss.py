"""The chunked, fused cross-entropy + z-loss equals the naive full-logits loss in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from olmo_ds.model import ModelConfig
from olmo_ds.model.loss import fused_linear_cross_entropy

from model_testlib import OLMO2_TINY, random_model


def naive_loss(hidden, weight, labels, z_loss_coef):
    logits = (hidden @ weight.t()).flatten(0, -2)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    labels = labels.flatten()
    valid = labels != -100
    ce = F.cross_entropy(logits, labels, ignore_index=-100)
    z = z_loss_coef * torch.logsumexp(logits, dim=-1)[valid].square().mean()
    return ce + z, ce, z


@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_fused_loss_matches_naive_value_and_gradients(chunk_size):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, generator=g)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g) * 0.5
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = -100
    labels[2, -1] = -100
    results = []
    for fn in (naive_loss, lambda *a: fused_linear_cross_entropy(*a, chunk_size=chunk_size)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, ce, z = fn(h, w, labels, 1e-2)
        (loss * 3.0).backward()  # a non-unit upstream gradient must scale the stored gradients
        results.append((loss.detach(), ce.detach(), z.detach(), h.grad, w.grad))
    for name, a, b in zip(("loss", "ce", "z", "grad hidden", "grad weight"), *results):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=f"{name} differs")
    assert results[1][2] > 0


def test_all_labels_ignored_gives_zero_loss_and_gradient():
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    loss, ce, z = fused_linear_cross_entropy(hidden, weight, torch.full((2, 5), -100), 1e-4)
    loss.backward()
    assert loss.item() == ce.item() == z.item() == 0.0
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_model_loss_equals_naive_loss_on_its_logits():
    cfg = ModelConfig(**OLMO2_TINY)
    model = random_model(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    out = model(ids, labels=labels, z_loss_coef=1e-4)
    out.loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss, ce, z = naive_loss(model.norm(_hidden(model, ids)), model.head.weight, labels, 1e-4)
    loss.backward()
    torch.testing.assert_close(out.ce_loss, ce.detach())
    torch.testing.assert_close(out.z_loss, z.detach())
    torch.testing.assert_close(out.loss, loss.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, msg=f"gradient of {name} differs")


def _hidden(model, ids):
    """The blocks' output, re-run through the model's own modules (no loss)."""
    from olmo_ds.model.attention import AttentionMask

    positions = torch.arange(ids.shape[1])
    tables = model._rope_tables(positions)
    mask = AttentionMask(*ids.shape, ids.device)
    x = model.embed(ids)
    for i, block in enumerate(model.blocks):
        x = block(x, *tables[model.cfg.layer_is_sliding(i)], mask)
    return x


def test_bf16_fused_loss_is_close_to_fp32_naive():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 64, 32, generator=g)
    weight = torch.randn(500, 32, generator=g) * 0.2
    labels = torch.randint(0, 500, (4, 64), generator=g)
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    loss, _, _ = fused_linear_cross_entropy(h, w, labels, 1e-4, chunk_size=100)
    loss.backward()
    h32, w32 = hidden.requires_grad_(), weight.requires_grad_()
    ref, _, _ = naive_loss(h32, w32, labels, 1e-4)
    ref.backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.float(), w32.grad, rtol=5e-2, atol=2e-4)
    torch.testing.assert_close(h.grad.float(), h32.grad, rtol=5e-2, atol=2e-4)


def test_fused_loss_keeps_no_logits_for_backward():
    """Autograd holds only [tokens, d] and [V, d] sized tensors, never [tokens, V] logits."""
    tokens, d, vocab = 256, 16, 1000
    hidden = torch.randn(tokens, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    for fn, expect_logits in ((naive_loss, True), (fused_linear_cross_entropy, False)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            fn(hidden, weight, labels, 1e-4)
        assert (max(saved) >= tokens * vocab) == expect_logits, (fn.__name__, max(saved))
