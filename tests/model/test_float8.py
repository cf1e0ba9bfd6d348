"""FP8 block matmuls (`ModelConfig.float8`, olmo_ds/model/float8.py) on CPU, where torch 2.13 runs
`torch._scaled_mm`: the real FP8 numerics, not an emulation.

What a user relies on: `float8.linear` is torchao's `Float8Linear` bit for bit; a model with `float8` on runs
its seven block matmuls (and their backward matmuls) in FP8 on the eager and the compiled path alike, and the
profiler's count of `aten::_scaled_mm` calls agrees with `BLOCK_CALLS`; no-grad forwards (evaluation) and the
LM head stay in the model's dtype; the errors name the key and value.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from torch.profiler import profile

from olmo_ds.model import ModelConfig, OLMo
from olmo_ds.model import float8 as fp8
from olmo_ds.model.config import EXECUTION_FIELDS
from olmo_ds.model.model import BLOCK_CALLS

needs_torchao = pytest.mark.skipif(fp8.unavailable() is not None, reason=f"model.float8: {fp8.unavailable()}")

# test_compile.py's shapes (so the bf16 graphs are shared); every matmul dimension a multiple of 16.
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, vocab_size=256, max_seq_len=64, compile="eager")


def batch(b: int = 2, t: int = 32):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (b, t), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)


def train_once(weights: dict, **fields):
    """Loss, gradients, BLOCK_CALLS and the number of `aten::_scaled_mm` calls of one forward/backward."""
    model = OLMo(dataclasses.replace(CFG, **fields))
    model.load_state_dict(weights)
    ids, labels = batch()
    BLOCK_CALLS.clear()
    with profile() as prof:
        out = model(ids, labels=labels, z_loss_coef=1e-4)
        out.loss.backward()
    scaled = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, dict(BLOCK_CALLS), scaled


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    return OLMo(CFG).state_dict()


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_torchao_float8_linear_bit_for_bit(recipe, dtype):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    fp8.prepare(recipe)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, dtype=dtype) * 0.05)
    ref = Float8Linear.from_float(torch.nn.Linear(64, 96, bias=False, dtype=dtype), config=Float8LinearConfig.from_recipe_name(recipe))
    ref.weight = torch.nn.Parameter(weight.detach().clone())
    x = torch.randn(2, 16, 64, dtype=dtype)
    grad = torch.randn(2, 16, 96, dtype=dtype)
    ours_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = fp8.linear(ours_x, weight, recipe)
    out.backward(grad)
    want = ref(ref_x)
    want.backward(grad)
    assert torch.equal(out, want) and out.dtype == dtype
    assert torch.equal(ours_x.grad, ref_x.grad) and torch.equal(weight.grad, ref.weight.grad)
    # FP8, not the weights' dtype: the product differs from the exact one by FP8's rounding.
    exact = x.float() @ weight.detach().float().t()
    assert 1e-3 < (out.float() - exact).abs().max() < 0.1 * exact.abs().max()


@needs_torchao
def test_fp8_runs_every_block_matmul_eager_and_compiled(weights):
    """Eager modules and compiled blocks both run the 7 matmuls per block in FP8 (2 layers: 14 forward, each
    with 2 backward: 42 `_scaled_mm` calls, no other), to the same loss and gradients; the bf16 model runs none."""
    loss, grads, calls, scaled = train_once(weights)
    assert calls == {"eager": 2} and scaled == 0
    e_loss, e_grads, e_calls, e_scaled = train_once(weights, float8="tensorwise")
    assert e_calls == {"eager": 2, "float8_matmuls": 14} and e_scaled == 42
    train_once(weights, float8="tensorwise", compile="blocks")  # compiles (tracing calls it with fake tensors too)
    c_loss, c_grads, c_calls, c_scaled = train_once(weights, float8="tensorwise", compile="blocks")
    assert c_calls == {"compiled": 2, "float8_matmuls": 14} and c_scaled == 42
    torch.testing.assert_close(c_loss, e_loss, rtol=1e-5, atol=1e-6)
    for name, grad in c_grads.items():
        torch.testing.assert_close(grad, e_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # FP8 changes the numbers by its rounding (e5m2 gradients: 2 mantissa bits), not their direction.
    assert e_loss != loss and abs(e_loss - loss) < 0.01 * loss
    for name in ("blocks.0.mlp.down_proj.weight", "blocks.1.attn.q_proj.weight", "head.weight"):
        cosine = torch.nn.functional.cosine_similarity(e_grads[name].flatten(), grads[name].flatten(), dim=0)
        assert not torch.equal(e_grads[name], grads[name]) and cosine > 0.95, (name, cosine)


@needs_torchao
def test_rowwise_and_activation_checkpointing_recompute_in_fp8(weights):
    _, _, calls, scaled = train_once(weights, float8="rowwise", activation_checkpointing=True)
    # Both blocks recomputed in backward: 2 x 7 forward matmuls again, each in FP8.
    assert calls == {"eager": 4, "float8_matmuls": 28} and scaled == 28 + 28


@needs_torchao
def test_no_grad_forwards_and_the_head_stay_in_the_model_dtype(weights):
    """Evaluation (no gradients) computes what the bf16 model computes: FP8 is a training setting."""
    off, on = OLMo(CFG), OLMo(dataclasses.replace(CFG, float8="tensorwise"))
    off.load_state_dict(weights)
    on.load_state_dict(weights)
    ids, _ = batch()
    BLOCK_CALLS.clear()
    with torch.no_grad(), profile() as prof:
        logits = on(ids)
    assert "aten::_scaled_mm" not in {e.key for e in prof.key_averages()} and "float8_matmuls" not in BLOCK_CALLS
    with torch.no_grad():
        assert torch.equal(logits, off(ids))


def test_float8_values_and_shapes_are_checked():
    assert dataclasses.replace(CFG, float8=False).float8 == "off"  # YAML's unquoted `off`
    # No scale state: the same parameters and no buffers whatever the recipe, so a run resumes under another value.
    assert "float8" in EXECUTION_FIELDS
    shapes = {n: p.shape for n, p in OLMo(CFG).state_dict().items()}
    for recipe in ("tensorwise", "rowwise"):
        model = OLMo(dataclasses.replace(CFG, float8=recipe))
        assert {n: p.shape for n, p in model.state_dict().items()} == shapes and not list(model.buffers())
    for bad in ("e4m3", True, "rowwise_with_gw_hp"):
        with pytest.raises(ValueError, match=r"model.float8 .* is not one of: off, tensorwise, rowwise"):
            dataclasses.replace(CFG, float8=bad)
    with pytest.raises(ValueError, match=r"model.float8 'tensorwise' needs .* multiples of 16 .*not: d_model 40, .*mlp_hidden 72"):
        dataclasses.replace(CFG, d_model=40, n_heads=2, n_kv_heads=2, mlp_hidden=72, float8="tensorwise")


def test_missing_torchao_and_unsuited_devices_are_named():
    with mock.patch.object(fp8, "_torchao", side_effect=ModuleNotFoundError("No module named 'torchao'", name="torchao")):
        assert fp8.unavailable() == f"torchao is not installed: {fp8.INSTALL}"
        with pytest.raises(RuntimeError, match=r"model.float8 'tensorwise': torchao is not installed: pip install 'torchao>=0.18'"):
            fp8.prepare.__wrapped__("tensorwise")
    assert fp8.device_problem("cuda", (8, 0), "NVIDIA A100-SXM4-80GB") == (
        "NVIDIA A100-SXM4-80GB is sm_80; FP8 matmuls need compute capability 8.9 or higher (Ada, Hopper, Blackwell)")
    assert fp8.device_problem("cuda", (8, 9), "NVIDIA L40S") is None and fp8.device_problem("cuda", (9, 0)) is None
    assert "not on mps" in fp8.device_problem("mps")
    assert fp8.device_problem("cpu") is None  # torch 2.13's CPU kernel for torch._scaled_mm
