"""Every attention backend agrees with a float64 reference: causal, sliding-window, document-masked, GQA.

SDPA and flex_attention run here on CPU; the GPU-only kernels (cuDNN/flash SDPA, FlashAttention-3)
run in bf16, forward and backward, against the same reference when a CUDA device is present, and are
skipped otherwise (FlashAttention-3 also where `make flash-attn` has not installed it).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.attention import AttentionMask, attend, resolve_backend

from model_testlib import OLMO2_TINY, OLMO3_TINY, random_model

B, T, H, H_KV, D = 2, 40, 4, 2, 16
DOC_LENS = torch.tensor([[7, 20, 13, 0], [1, 3, 30, 6]], dtype=torch.int32)
CASES = {
    "causal": (None, None),
    "sliding": (6, None),
    "documents": (None, DOC_LENS),
    "sliding+documents": (6, DOC_LENS),
}


def reference(q, k, v, window, doc_lens):
    """Plain float64 softmax attention with an explicit (query, key) rule."""
    q, k, v = q.double(), k.double(), v.double()
    t = q.shape[1]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (j <= i) & (j > i - window if window else True)
    allowed = allowed.expand(q.shape[0], t, t)
    if doc_lens is not None:
        doc = torch.stack([torch.repeat_interleave(torch.arange(len(r)), r.long()) for r in doc_lens])
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def inputs(dtype, device="cpu", shape=(B, T, H, H_KV, D)):
    b, t, h, h_kv, d = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, h_kv, d, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "sdpa_flash", "flex"])
def test_cpu_backends_match_float64_reference(backend, case):
    window, doc_lens = CASES[case]
    q, k, v = inputs(torch.float64)
    mask = AttentionMask(B, T, q.device, doc_lens)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = attend(q, k, v, mask, window, resolve_backend(backend, q.device, window or doc_lens is not None),
                     D ** -0.5)
    torch.testing.assert_close(out, reference(q, k, v, window, doc_lens), rtol=1e-10, atol=1e-10)


GPU_BACKENDS = {
    "auto": None, "sdpa": None, "sdpa_cudnn": None, "sdpa_efficient": None, "sdpa_flash": None, "flex": None,
    "flash_attn3": "flash_attn_interface",
}


# The kernels' real tiling needs real sizes: OLMo's head_dim 128, several key blocks, 4:1 GQA.
LARGE = (2, 1024, 8, 2, 128)
LARGE_CASES = {
    "causal": (None, None),
    "sliding": (256, None),
    "documents": (None, torch.tensor([[300, 524, 200], [1024, 0, 0]], dtype=torch.int32)),
    "sliding+documents": (256, torch.tensor([[300, 524, 200], [17, 1000, 7]], dtype=torch.int32)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only attention kernels need CUDA")
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", list(GPU_BACKENDS))
def test_gpu_backends_match_float64_reference(backend, case, size):
    module = GPU_BACKENDS[backend]
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    shape = (B, T, H, H_KV, D) if size == "small" else LARGE
    window, doc_lens = (CASES if size == "small" else LARGE_CASES)[case]
    if backend == "sdpa_flash" and (window or doc_lens is not None):
        pytest.skip("the flash SDPA kernel takes no mask")
    q, k, v = (t.requires_grad_() for t in inputs(torch.bfloat16, "cuda", shape))
    mask = AttentionMask(shape[0], shape[1], q.device, doc_lens)
    out = attend(q, k, v, mask, window, resolve_backend(backend, q.device, window or doc_lens is not None), shape[-1] ** -0.5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad_out.to(out))
    ref = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    expected = reference(*ref, window, doc_lens)
    expected.backward(grad_out)
    err = (out.double().cpu() - expected).abs().max().item()
    grad_errs = [((t.grad.double().cpu() - r.grad).abs().max() / r.grad.abs().max()).item() for t, r in zip((q, k, v), ref)]
    print(f"{backend} {case} {size}: max |out - float64| = {err:.2e}, grads (q, k, v) relative to their max: "
          + ", ".join(f"{e:.2e}" for e in grad_errs))
    torch.testing.assert_close(out.double().cpu(), expected.detach(), rtol=2e-2, atol=2e-2)
    for name, e in zip("qkv", grad_errs):
        assert e < 3e-2, f"d{name}: max error {e:.2e} of the largest float64 gradient"


def test_auto_picks_sdpa_on_cpu_and_gpu_only_backends_refuse_cpu():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, needs_mask=True) == "sdpa"
    for name in ("flash_attn3", "sdpa_cudnn", "sdpa_efficient"):
        with pytest.raises(ValueError, match="CUDA"):
            resolve_backend(name, cpu, needs_mask=False)


def test_auto_keeps_masked_layers_on_flex_even_with_flash_attn3_installed(monkeypatch):
    """The measured choice (BENCHMARKS.md, "flash-attn on the GPU"): FlashAttention-3 layers run eagerly and lose
    the training step to compiled flex, so `auto` never picks it; plain causal layers go to cuDNN first."""
    monkeypatch.setattr("olmo_ds.model.attention._has_module", lambda name: True)
    cuda = torch.device("cuda", 0)
    assert resolve_backend("auto", cuda, needs_mask=True) == "flex"
    assert resolve_backend("auto", cuda, needs_mask=False) == "sdpa_cudnn_first"


def test_unverified_flash_attn_2_is_refused_by_the_config():
    """flash-attn 2.x has never run here (BENCHMARKS.md, "flash-attn on the GPU"): the config says so."""
    with pytest.raises(ValueError, match=r"'flash_attn' is refused: .*unverified.*'flash_attn3'"):
        ModelConfig(attention_backend="flash_attn")


def test_flash_attn3_is_refused_off_hopper(monkeypatch):
    """FlashAttention-3 was built and verified on sm90 only: an sm80 card is told to use auto."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"Hopper GPUs \(sm90\) only; NVIDIA A100-SXM4-80GB is sm80: use 'auto'"):
        resolve_backend("flash_attn3", torch.device("cuda", 0), needs_mask=False)


def test_bad_doc_lens_are_rejected_before_attention():
    with pytest.raises(ValueError, match="sum to the sequence length"):
        AttentionMask(2, T, torch.device("cpu"), torch.tensor([[10, 20], [40, 0]]))
    with pytest.raises(ValueError, match="shape"):
        AttentionMask(2, T, torch.device("cpu"), torch.tensor([40, 40]))


@pytest.mark.parametrize("spec", [OLMO2_TINY, OLMO3_TINY], ids=["olmo2", "olmo3"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_document_masking_equals_running_each_document_alone(spec, backend):
    """Packed documents with doc_lens give each document the logits it gets on its own.

    RoPE is relative, so a document's offset inside the row changes its scores only by the fp32
    rounding of the RoPE tables (~1e-7).
    """
    cfg = ModelConfig(**dict(spec, attention_backend=backend))
    model = random_model(cfg).double()
    lens = [9, 23, 8]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        packed = model(ids, doc_lens=torch.tensor([lens]))
        start = 0
        for n in lens:
            alone = model(ids[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-6)
            start += n
        unmasked = model(ids)
    assert (unmasked[:, lens[0]:] - packed[:, lens[0]:]).abs().max() > 1e-3
