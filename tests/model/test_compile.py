"""Compiled blocks (`ModelConfig.compile`): the same function as the eager modules, taken only where exact.

Inductor compiles `block_math` for the CPU here (gcc); the model's shape is tiny so the first compile of
the forward and backward graphs takes ~20 s on 2 cores, and the later tests reuse those graphs (same
shapes, same grad mode). Tolerances are fp32 rounding: inductor fuses and reorders reductions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from olmo_ds.model import ModelConfig, OLMo
from olmo_ds.model.attention import AttentionMask
from olmo_ds.model.generate import generate
from olmo_ds.model.model import BLOCK_CALLS

# GQA (2 heads, 1 kv head) like the 2-rank trainer test's model, so both compile the same graphs.
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, vocab_size=256, max_seq_len=64, compile="eager")


def twin_models(**compiled_fields) -> tuple[OLMo, OLMo]:
    """An eager model with every weight random (norms too) and a copy with compiled blocks."""
    torch.manual_seed(0)
    eager = OLMo(CFG)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    compiled = OLMo(dataclasses.replace(CFG, compile="blocks", **compiled_fields))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def batch(b: int = 2, t: int = 32):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (b, t), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)


def loss_and_grads(model: OLMo, ids, labels, **kw):
    model.zero_grad()
    out = model(ids, labels=labels, z_loss_coef=1e-4, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_training_math(eager: OLMo, compiled: OLMo, **kw) -> None:
    ids, labels = batch()
    loss, grads = loss_and_grads(compiled, ids, labels, **kw)
    ref_loss, ref_grads = loss_and_grads(eager, ids, labels, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_blocks_match_eager_forward_and_backward():
    eager, compiled = twin_models()
    ids, _ = batch()
    BLOCK_CALLS.clear()
    torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-5, atol=1e-5)  # logits
    assert BLOCK_CALLS == {"compiled": 2, "eager": 2}  # the compiled model's 2 layers, then the eager model's
    BLOCK_CALLS.clear()
    assert_same_training_math(eager, compiled)
    assert BLOCK_CALLS == {"compiled": 2, "eager": 2}
    BLOCK_CALLS.clear()
    with torch.no_grad():  # evaluation and inference stay eager (their shapes vary)
        compiled(ids)
    assert BLOCK_CALLS == {"eager": 2}


def test_activation_checkpointing_recomputes_compiled_blocks_exactly():
    eager, compiled = twin_models(activation_checkpointing=True)
    BLOCK_CALLS.clear()
    assert_same_training_math(eager, compiled)
    assert BLOCK_CALLS["compiled"] == 4  # 2 layers, each run forward and again in backward


def test_compiled_path_is_skipped_where_it_would_not_be_exact():
    """Document masks, sliding windows, the KV cache, non-SDPA backends and `compile: auto` on CPU run eagerly
    (as does anything without gradients, above)."""
    eager, compiled = twin_models()
    ids, labels = batch()
    BLOCK_CALLS.clear()
    assert_same_training_math(eager, compiled, doc_lens=torch.tensor([[10, 22], [32, 0]]))
    assert BLOCK_CALLS == {"eager": 4}

    for fields, expected in [(dict(sliding_window=8, sliding_window_pattern=[True]), {"eager": 1, "compiled": 1}),
                             (dict(compile="auto"), {"eager": 2})]:
        model = OLMo(dataclasses.replace(CFG, **{"compile": "blocks", **fields}))
        model.load_state_dict(eager.state_dict())
        BLOCK_CALLS.clear()
        model(ids, labels=labels)
        assert BLOCK_CALLS == expected, fields
    # flex_attention has no backward on CPU, so its rule is checked without running the block.
    flex = OLMo(dataclasses.replace(CFG, compile="blocks", attention_backend="flex")).blocks[0]
    x = torch.zeros(2, 32, CFG.d_model)
    assert flex._compiled_backend(x, AttentionMask(2, 32, x.device), None) is None
    assert compiled.blocks[0]._compiled_backend(x, AttentionMask(2, 32, x.device), None) == "sdpa"

    BLOCK_CALLS.clear()
    prompt = ids[:1, :4].tolist()
    assert generate(compiled, prompt, max_new_tokens=3) == generate(eager, prompt, max_new_tokens=3)
    assert "compiled" not in BLOCK_CALLS


def test_compile_mode_must_be_known():
    with pytest.raises(ValueError, match=r"model.compile 'yes' is not one of: auto, blocks, eager"):
        dataclasses.replace(CFG, compile="yes")
