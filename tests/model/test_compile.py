"""Compiled blocks (`ModelConfig.compile`): the same function as the eager modules, taken only where exact.

Inductor compiles `block_math` for the CPU here (gcc); the model's shape is tiny so the first compile of
the forward and backward graphs takes ~20 s on 2 cores, and the later tests reuse those graphs (same
shapes, same grad mode). Tolerances are fp32 rounding: inductor fuses and reorders reductions.
"""

from __future__ import annotations

import collections

import dataclasses
import warnings
from unittest import mock

import pytest
import torch

from olmo_ds.model import ModelConfig, OLMo
from olmo_ds.model.attention import AttentionMask
from olmo_ds.model.decode import Request, generate
from olmo_ds.model.model import BLOCK_CALLS, _RowShapedCompile, block_math

# GQA (2 heads, 1 kv head) like the 2-rank trainer test's model, so both compile the same graphs.
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, vocab_size=256, max_seq_len=64, compile="eager")


def twin_models(shared: dict | None = None, **compiled_fields) -> tuple[OLMo, OLMo]:
    """An eager model (CFG with `shared` fields) with every weight random (norms too) and a copy with compiled blocks."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, **(shared or {}))
    eager = OLMo(cfg)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    compiled = OLMo(dataclasses.replace(cfg, compile="blocks", **compiled_fields))
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


@pytest.mark.parametrize("setting, recomputed", [(True, 2), ("full", 2), ("every_k:2", 1), (False, 0)])
def test_activation_checkpointing_recomputes_compiled_blocks_exactly(setting, recomputed):
    eager, compiled = twin_models(activation_checkpointing=setting)
    BLOCK_CALLS.clear()
    assert_same_training_math(eager, compiled)
    assert BLOCK_CALLS["compiled"] == 2 + recomputed  # 2 layers forward, and the checkpointed ones again in backward


@pytest.mark.parametrize("value", ["every_k:0", "every_k:x", "attention", 2])
def test_activation_checkpointing_form_must_be_known(value):
    with pytest.raises(ValueError, match=r"model.activation_checkpointing .* is not one of: false, true, full, every_k:N"):
        dataclasses.replace(CFG, activation_checkpointing=value)


WINDOWED = dict(sliding_window=8, sliding_window_pattern=[True])  # layer 0 sliding, layer 1 (the last) full
DOC_LENS = torch.tensor([[10, 22], [3, 29]])


@pytest.mark.parametrize("fields, doc_lens", [(WINDOWED, None), ({}, DOC_LENS), (WINDOWED, DOC_LENS)],
                         ids=["window", "documents", "window+documents"])
def test_windowed_and_document_masked_blocks_compile_and_match_eager(fields, doc_lens):
    """Sliding windows and document masks take the compiled path with the mask passed in (SDPA's boolean
    mask on CPU, where flex has no backward): same loss and gradients as the eager modules."""
    eager, compiled = twin_models(fields)
    BLOCK_CALLS.clear()
    assert_same_training_math(eager, compiled, doc_lens=doc_lens)
    assert BLOCK_CALLS == {"compiled": 2, "eager": 2}


def test_flex_compiled_block_matches_eager_and_compiles_once_per_mask_kind():
    """flex_attention inside the compiled block (forward only: flex has no CPU backward) equals the eager
    block, and new batches (new documents, new BlockMasks) reuse the graphs: no recompilation per batch."""
    from torch._dynamo.utils import counters

    eager, compiled = twin_models(dict(WINDOWED, attention_backend="flex"))
    for model in (eager, compiled):
        model.requires_grad_(False)  # gradients stay enabled (the compiled path's condition), weights need none
    graphs = []
    for seed, doc_lens in enumerate([DOC_LENS, torch.tensor([[32, 0], [7, 25]]), torch.tensor([[1, 31], [16, 16]])]):
        x = torch.randn(2, 32, CFG.d_model, generator=torch.Generator().manual_seed(seed))
        mask = AttentionMask(2, 32, x.device, doc_lens)  # one per batch, as OLMo.forward builds it
        for layer in (0, 1):  # sliding, then full: two mask kinds
            cos, sin = compiled._cached_rope_tables(32, x.device)[compiled.cfg.layer_is_sliding(layer)]
            BLOCK_CALLS.clear()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                out = compiled.blocks[layer](x, cos, sin, mask)
                ref = eager.blocks[layer](x, cos, sin, mask)
            assert BLOCK_CALLS == {"compiled": 1, "eager": 1}
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[2] == graphs[0], graphs


def test_compiled_path_is_skipped_where_it_would_not_be_exact():
    """The KV cache, flash-attn backends and `compile: auto` on CPU run eagerly (as does anything without
    gradients, above)."""
    eager, compiled = twin_models()
    ids, labels = batch()
    model = OLMo(dataclasses.replace(CFG, compile="auto"))
    model.load_state_dict(eager.state_dict())
    BLOCK_CALLS.clear()
    model(ids, labels=labels)
    assert BLOCK_CALLS == {"eager": 2}
    # flash-attn needs CUDA, so its rule is checked without running the block.
    flash = OLMo(dataclasses.replace(CFG, compile="blocks", attention_backend="flash_attn3")).blocks[0]
    x = torch.zeros(2, 32, CFG.d_model)
    with mock.patch("olmo_ds.model.model._resolved_backend", return_value="flash_attn3"):
        assert flash._compiled_attention(x, AttentionMask(2, 32, x.device), None) is None
    assert compiled.blocks[0]._compiled_attention(x, AttentionMask(2, 32, x.device), None) == ("sdpa", None)

    BLOCK_CALLS.clear()
    requests = [Request(ids[0, :4].tolist(), 3)]
    assert generate(compiled, requests).completions == generate(eager, requests).completions
    assert "compiled" not in BLOCK_CALLS


def scoring_batch(seed: int, b: int = 2, t: int = 32):
    """A batch as evaluation packs it (`olmo_ds.eval.packing`): per row, a context (branch 0) and two
    continuations (branches 1, 2) whose positions continue from the context's end, then padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (b, t), generator=g)
    n = int(torch.randint(4, 12, (), generator=g))
    branches = torch.tensor([0] * n + [1] * 5 + [2] * 6 + [0] * (t - n - 11), dtype=torch.int32).expand(b, t)
    positions = torch.tensor(list(range(n + 5)) + list(range(n, n + 6)) + [0] * (t - n - 11)).expand(b, t)
    doc_lens = torch.tensor([[n + 11, t - n - 11]]).expand(b, 2)
    index = torch.arange(b * t)
    return dict(doc_lens=doc_lens, positions=positions, branches=branches), ids, (index, ids.roll(-1, 1).reshape(-1))


def test_scoring_forwards_run_compiled_blocks_under_no_grad_and_compile_once_per_shape():
    """A scoring forward (`score=`, evaluation) takes the compiled blocks without gradients too, through a
    compiled function of its own: packed rows with branches give the eager model's scores, and further
    batches of the same shape (other layouts, other masks) build no new graph."""
    from torch._dynamo.utils import counters

    eager, compiled = twin_models(WINDOWED)
    graphs = []
    with torch.no_grad():
        for seed in range(3):
            kwargs, ids, score = scoring_batch(seed)
            BLOCK_CALLS.clear()
            got = compiled(ids, score=score, **kwargs)
            want = eager(ids, score=score, **kwargs)
            assert BLOCK_CALLS == {"compiled": 2, "eager": 2}
            torch.testing.assert_close(got.logprob, want.logprob, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.greedy, want.greedy)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2], graphs


def test_block_math_multiplies_with_torchs_linear_whatever_replaces_functional_linear():
    """`deepspeed.zero.Init` with `memory_efficient_linear` (DeepSpeed's default) replaces `torch.nn.functional.linear`
    process-wide with an autograd function whose backward reads each weight's ZeRO-3 attributes, and torch 2.11's dynamo
    guards on them: a graph per layer. The compiled block calls torch's own linear, so no graph depends on the layer
    (under ZeRO-3: test_compile_zero3.py)."""
    eager, compiled = twin_models()
    x = torch.randn(2, 32, CFG.d_model, generator=torch.Generator().manual_seed(3))
    cos, sin = compiled._cached_rope_tables(32, x.device)[False]
    want = eager.blocks[0](x, cos, sin, AttentionMask(2, 32, x.device))

    def replaced(*args, **kwargs):
        raise AssertionError("block_math called torch.nn.functional.linear")

    block = compiled.blocks[0]
    with mock.patch("torch.nn.functional.linear", replaced):
        got = block_math(x, cos, sin, *block.weights(), eps=block.attn_norm.eps, n_heads=block.attn.n_heads,
                         n_kv_heads=block.attn.n_kv_heads, backend="sdpa")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_shaped_compile_holds_three_graphs_for_any_number_of_row_shapes():
    """The first rows' shape compiles a static graph, a batch of one its own, and every other shape one graph with
    dynamic rows: 3 for 6 shapes (a graph per shape would be 6), each giving the uncompiled function's values."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def rows_times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x @ w).sum(-1, keepdim=True) * x

    fn, w = _RowShapedCompile(rows_times), torch.randn(8, 8)
    for b, t in [(2, 16), (2, 24), (3, 8), (1, 5), (1, 40), (5, 3)]:
        x = torch.randn(b, t, 8)
        torch.testing.assert_close(fn(x, w), rows_times(x, w), rtol=1e-5, atol=1e-5)
    assert len(_debug_get_cache_entry_list(rows_times.__code__)) == 3


def test_a_recompile_limit_reached_is_counted_as_eager_not_compiled(caplog):
    """Past dynamo's recompile limit the function runs eagerly and says so (`BLOCK_CALLS`, one warning), instead of
    dynamo's silent eager frames counted as compiled calls. Each new `mode` (a string constant) is a new graph."""
    from olmo_ds.model.model import BLOCK_CALLS

    def scaled(x: torch.Tensor, mode: str) -> torch.Tensor:
        return torch.nn.functional.silu(x) * len(mode)

    fn, x = _RowShapedCompile(scaled), torch.randn(2, 4, 8)
    before = collections.Counter(BLOCK_CALLS)
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level("WARNING", logger="olmo_ds"):
        for mode in ("a", "bb", "ccc", "dddd", "eeeee"):
            torch.testing.assert_close(fn(x, mode), scaled(x, mode))
    calls = collections.Counter(BLOCK_CALLS)
    calls.subtract(before)
    assert (calls["compiled"], calls["eager"], calls["compile_fallbacks"]) == (2, 3, 1) and fn.exhausted
    assert sum("reached its recompile limit" in r.message for r in caplog.records) == 1


def test_compile_mode_must_be_known():
    with pytest.raises(ValueError, match=r"model.compile 'yes' is not one of: auto, blocks, eager"):
        dataclasses.replace(CFG, compile="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention needs CUDA")
def test_gpu_scoring_with_compiled_flex_blocks_in_bf16_matches_eager_fp32():
    """On CUDA, packed scoring rows through compiled blocks with flex_attention (the path evaluation takes)
    in bf16 give the fp32 eager model's log-probs within bf16's rounding."""
    cfg = ModelConfig(d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=512, vocab_size=512, max_seq_len=1024,
                      sliding_window=256, sliding_window_pattern=[True])
    torch.manual_seed(0)
    eager = OLMo(dataclasses.replace(cfg, compile="eager", attention_backend="sdpa")).cuda()
    compiled = OLMo(dataclasses.replace(cfg, compile="blocks", attention_backend="auto")).cuda().bfloat16()
    compiled.load_state_dict(eager.state_dict())
    kwargs, ids, score = scoring_batch(0, b=4, t=512)
    kwargs, ids, score = ({k: v.cuda() for k, v in kwargs.items()}, ids.cuda(), tuple(x.cuda() for x in score))
    with torch.no_grad():
        BLOCK_CALLS.clear()
        got = compiled(ids, score=score, **kwargs)
        want = eager(ids, score=score, **kwargs)
    assert BLOCK_CALLS == {"compiled": 2, "eager": 2}
    assert (got.logprob - want.logprob).abs().max() < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward needs CUDA")
@pytest.mark.parametrize("doc_lens", [None, torch.tensor([[300, 524, 200], [17, 1000, 7]])], ids=["window", "window+documents"])
def test_gpu_flex_compiled_blocks_train_like_eager_sdpa_in_bf16(doc_lens):
    """On CUDA, in bf16 at real tile sizes (head_dim 128, 8 key tiles, 256-token window): compiled blocks with
    flex_attention give the loss and gradients of eager blocks with SDPA and a boolean mask (another kernel)."""
    cfg = ModelConfig(d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=512, vocab_size=512, max_seq_len=1024,
                      sliding_window=256, sliding_window_pattern=[True])
    torch.manual_seed(0)
    eager = OLMo(dataclasses.replace(cfg, compile="eager", attention_backend="sdpa")).cuda().bfloat16()
    compiled = OLMo(dataclasses.replace(cfg, compile="blocks", attention_backend="flex")).cuda().bfloat16()
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100, device="cuda")], dim=1)
    BLOCK_CALLS.clear()
    loss, grads = loss_and_grads(compiled, ids, labels, doc_lens=doc_lens)
    ref_loss, ref_grads = loss_and_grads(eager, ids, labels, doc_lens=doc_lens)
    assert BLOCK_CALLS == {"compiled": 2, "eager": 2}
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=1e-2, atol=1e-2)
    for name, grad in grads.items():
        err = (grad.float() - ref_grads[name].float()).norm() / ref_grads[name].float().norm()
        assert err < 3e-2, (name, err.item())
