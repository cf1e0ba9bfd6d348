"""One attention interface over several kernels: PyTorch SDPA, flex_attention and FlashAttention-3.

Every backend computes the same thing: causal softmax attention with optional grouped-query heads,
an optional sliding window and optional document masking (tokens attend only within their own
document when several documents are packed into one row). The masks are described once per forward
by an `AttentionMask` and each backend turns that description into what its kernel wants (a boolean
matrix for SDPA, a block mask for flex, cumulative sequence lengths for flash-attn varlen); the
model's layers share it, so a block mask is built once per forward, not once per layer, and the
compiled block (`model.block_math`) takes it as an argument (`kernel_mask`, `kernel_attention`).

Sliding window semantics follow transformers' OLMo 3: a query at position i sees keys j with
i - window < j <= i, i.e. `window` keys including itself (flash-attn `window_size=(window - 1, 0)`).

Backends (`ModelConfig.attention_backend`):
- `sdpa`: `F.scaled_dot_product_attention`, PyTorch chooses the kernel. `sdpa_cudnn`, `sdpa_flash`,
  `sdpa_efficient`, `sdpa_math` pin one kernel (on CPU only flash and math exist). Sliding windows and
  documents use a boolean mask, which on CUDA only the memory-efficient, cuDNN and math kernels accept.
- `flex`: `torch.nn.attention.flex_attention` with block masks (tiles classified from the window and
  document boundaries, `masking.flex_block_mask`); compiled on GPU, eager on CPU (forward only there).
- `flash_attn3`: FlashAttention-3 (`flash_attn_interface`), Hopper only, built by `make flash-attn`
  (olmo_ds/tools/flash_attn_build.py). The flash-attn 2.x package (`flash_attn`) is refused by the config
  as unverified (`config.REFUSED_ATTENTION_BACKENDS`): it has never run here.
- `auto`: on CPU, SDPA. On GPU, plain causal attention goes to SDPA with cuDNN first, masked attention
  (sliding windows, documents) to flex_attention when triton is there, else SDPA with a mask. Chosen by
  measurement on an H100 (BENCHMARKS.md, "flash-attn on the GPU"): FlashAttention-3's kernels are the
  fastest (forward+backward 541-565 TFLOP/s causal and windowed at seq 4096-8192, against cuDNN's 494-550
  causal and flex's 328-372), but its layers run the eager modules (`model._COMPILED_BACKENDS`), and the
  compiled blocks win the training step: the 1B at seq 8192 with OLMo 3's window trains at 46.8K tokens/s
  with `auto` (flex) against 40.1K when `auto` sent masked layers to FlashAttention-3 and 37.6K with every
  layer on it; at seq 4096, 52.1K full and 53.3K document-masked against 38.9K and 39.7K. FlashAttention-3
  stays a backend to ask for (`flash_attn3`), e.g. for eager paths or once it runs inside compiled blocks.
The GPU-only packages are imported lazily so the CPU install never needs them.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from olmo_ds.model.masking import cu_seqlens, document_ids, flex_block_mask

_SDPA_KERNELS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def resolve_backend(name: str, device: torch.device, needs_mask: bool, tree: bool = False) -> str:
    """The concrete backend for `name` on `device`; `needs_mask` = sliding window or documents; `tree` =
    the mask has branches (`AttentionMask`), which flash-attn's kernels cannot express: those calls go
    to flex_attention on CUDA with triton, else to SDPA with a boolean mask, whatever was asked for."""
    if tree and name in ("flash_attn3", "sdpa_flash"):
        name = "auto"
    resolved = _resolve(name, device, needs_mask or tree)
    if tree and resolved == "flash_attn3":
        return "flex" if _has_module("triton") else "sdpa"
    return resolved


def _resolve(name: str, device: torch.device, needs_mask: bool) -> str:
    if name != "auto":
        if name in ("flash_attn3", "sdpa_cudnn", "sdpa_efficient") and device.type != "cuda":
            raise ValueError(f"attention_backend {name!r} needs a CUDA device, got {device}; use 'auto' or 'sdpa'")
        if name == "flash_attn3":
            if torch.cuda.get_device_capability(device)[0] != 9:
                raise ValueError("attention_backend 'flash_attn3' (FlashAttention-3) is built and verified for Hopper "
                                 f"GPUs (sm90) only; {torch.cuda.get_device_name(device)} is sm"
                                 f"{''.join(map(str, torch.cuda.get_device_capability(device)))}: use 'auto'")
            if not _has_module("flash_attn_interface"):
                raise ValueError("attention_backend 'flash_attn3' needs FlashAttention-3 (the flash_attn_interface "
                                 "module): build and install it with `make flash-attn`")
        if name == "sdpa_flash" and needs_mask and device.type == "cuda":
            raise ValueError("attention_backend 'sdpa_flash' cannot apply sliding-window or document masks on CUDA; "
                             "use 'auto', 'flex' or 'flash_attn3'")
        return name
    if device.type != "cuda":
        return "sdpa"
    if not needs_mask:
        return "sdpa_cudnn_first"
    if _has_module("triton"):
        return "flex"
    return "sdpa"


def validate_doc_lens(doc_lens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Check the loader's `doc_lens` (int [B, D], zero-padded on the right, each row summing to T;
    see olmo_ds/model/masking.py) before any kernel sees it."""
    if doc_lens.dim() != 2 or doc_lens.shape[0] != batch:
        raise ValueError(f"doc_lens must have shape [batch={batch}, max_docs], got {tuple(doc_lens.shape)}")
    if doc_lens.dtype.is_floating_point:
        raise ValueError(f"doc_lens must be an integer tensor, got {doc_lens.dtype}")
    if bool((doc_lens < 0).any()):
        raise ValueError("doc_lens has negative lengths")
    sums = doc_lens.sum(dim=1)
    if bool((sums != seq_len).any()):
        raise ValueError(f"every row of doc_lens must sum to the sequence length {seq_len}, got sums {sums.tolist()}")
    return doc_lens


class AttentionMask:
    """The masking of one forward pass: causal always, plus documents and per-layer windows.

    Built once in the model's forward and passed to every layer; the kernel-specific forms are
    computed on first use and cached (one per window size).

    Branches (scoring, `olmo_ds.eval.loglikelihood`): `branches` [B, T] numbers the pieces of each
    document: 0 is its shared prefix, k > 0 its k-th branch, which sees the prefix and itself but no
    other branch, so the continuations of one context are scored in one row after one copy of it.
    `positions` [B, T] are then the RoPE positions (a branch continues from the end of the prefix),
    and sliding windows are measured in positions, not row offsets. `static_shapes`: the caller keeps
    its batches to a few shapes, so compiled blocks may serve a no-grad forward too (`Block`).
    """

    def __init__(self, batch: int, seq_len: int, device: torch.device, doc_lens: torch.Tensor | None = None,
                 branches: torch.Tensor | None = None, positions: torch.Tensor | None = None, static_shapes: bool = False):
        self.batch, self.seq_len, self.device = batch, seq_len, device
        self.doc_lens = None
        if doc_lens is not None:
            self.doc_lens = validate_doc_lens(doc_lens, batch, seq_len).to(device=device)
        if branches is not None and doc_lens is None:
            raise ValueError("branches need doc_lens (each branch belongs to a document's prefix)")
        for name, t in (("branches", branches), ("positions", positions)):
            if t is not None and tuple(t.shape) != (batch, seq_len):
                raise ValueError(f"{name} must have shape [batch={batch}, seq_len={seq_len}], got {tuple(t.shape)}")
        self.branches = None if branches is None else branches.to(device=device)
        self.positions = None if positions is None else positions.to(device=device)
        self.static_shapes = static_shapes
        self._cache: dict = {}

    @property
    def has_documents(self) -> bool:
        return self.doc_lens is not None

    @property
    def has_branches(self) -> bool:
        return self.branches is not None

    @functools.cached_property
    def doc_ids(self) -> torch.Tensor:
        """[B, T] index of the document each token belongs to."""
        return document_ids(self.doc_lens, self.seq_len)

    @functools.cached_property
    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """flash-attn varlen form: int32 cumulative document lengths over the flattened batch, and the max."""
        return cu_seqlens(self.doc_lens)

    def dense(self, window: int | None) -> torch.Tensor:
        """Boolean [B or 1, 1, T, T] mask, True where attention is allowed."""
        key = ("dense", window)
        if key not in self._cache:
            q = torch.arange(self.seq_len, device=self.device)[:, None]
            k = torch.arange(self.seq_len, device=self.device)[None, :]
            allowed = (k <= q)[None]
            if window is not None:
                if self.positions is not None:
                    allowed = allowed & (self.positions[:, :, None] - self.positions[:, None, :] < window)
                else:
                    allowed = allowed & (k > q - window)
            if self.has_documents:
                ids = self.doc_ids
                allowed = allowed & (ids[:, :, None] == ids[:, None, :])
            if self.has_branches:
                br = self.branches
                allowed = allowed & ((br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None]))
            self._cache[key] = allowed[:, None]
        return self._cache[key]

    def block_mask(self, window: int | None):
        """flex_attention BlockMask for this mask and window (tiles from `masking.flex_block_mask`)."""
        key = ("block", window)
        if key not in self._cache:
            doc_ids = self.doc_ids if self.has_documents else None
            branches, positions = self.branches, self.positions

            def mask_mod(b, h, q_idx, kv_idx):
                allowed = kv_idx <= q_idx
                if window is not None:
                    if positions is not None:
                        allowed = allowed & (positions[b, q_idx] - positions[b, kv_idx] < window)
                    else:
                        allowed = allowed & (kv_idx > q_idx - window)
                if doc_ids is not None:
                    allowed = allowed & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
                if branches is not None:
                    allowed = allowed & ((branches[b, kv_idx] == 0) | (branches[b, kv_idx] == branches[b, q_idx]))
                return allowed

            self._cache[key] = flex_block_mask(mask_mod, self.seq_len, self.device, window, doc_ids,
                                               branches=branches, positions=positions)
        return self._cache[key]

    def kernel_mask(self, backend: str, window: int | None):
        """What `backend`'s kernel (flex or SDPA) takes for this mask and window: a flex BlockMask, or
        for SDPA None where plain causal attention is all there is, else the boolean mask. Built once
        per forward and window and shared by the layers (eager and compiled alike)."""
        if backend == "flex":
            return self.block_mask(window)
        if window is None and not self.has_documents:
            return None
        return self.dense(window)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q, k, v, block_mask, scale: float) -> torch.Tensor:
    """flex_attention over [B, T, H, D] tensors. Eager calls on CUDA go through a compiled flex (the
    unfused fallback materialises every score); inside a compiled block (`model.block_math`) the
    plain function is traced into that block's graph; on CPU it runs eagerly (forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    out = fn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def sdpa(q, k, v, scale: float, backend: str, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch SDPA with `backend`'s kernel choice (a pinned kernel, cuDNN first, or PyTorch's pick):
    causal without `attn_mask`, else that boolean mask. q [B, T, H, D], k and v [B, T, H_kv, D] ->
    [B, T, H, D]. Also the attention of the compiled block (`model.block_math`), so both paths run
    the same kernels; written with one `with` per branch so torch.compile traces it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[2] != k.shape[2]
    if gqa and backend in ("sdpa_cudnn", "sdpa_efficient"):
        # These kernels take no `enable_gqa`; share kv heads by expanding them.
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        gqa = False
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kwargs = dict(attn_mask=attn_mask, is_causal=attn_mask is None, scale=scale, enable_gqa=gqa)
    if backend in _SDPA_KERNELS:
        with sdpa_kernel(getattr(SDPBackend, _SDPA_KERNELS[backend])):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    elif backend == "sdpa_cudnn_first":
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out.transpose(1, 2)


def kernel_attention(q, k, v, scale: float, backend: str, kernel_mask) -> torch.Tensor:
    """Attention through flex or an SDPA backend with the mask `AttentionMask.kernel_mask` made for
    it: what both the eager layers and the compiled block (`model.block_math`) run."""
    if backend == "flex":
        return flex(q, k, v, kernel_mask, scale)
    return sdpa(q, k, v, scale, backend, kernel_mask)


def flash_attn3(q, k, v, mask: AttentionMask, window, scale) -> torch.Tensor:
    """FlashAttention-3: `flash_attn_func`, or its varlen form over the flattened batch for documents."""
    import flash_attn_interface as fa

    window_size = (window - 1, 0) if window is not None else (-1, -1)
    if mask.has_documents:
        cu, max_len = mask.cu_seqlens
        b, t = q.shape[:2]
        out = fa.flash_attn_varlen_func(
            q.reshape(b * t, *q.shape[2:]), k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]),
            cu, cu, max_len, max_len, softmax_scale=scale, causal=True, window_size=window_size,
        )
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(b, t, *out.shape[1:])
    out = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=window_size)
    return out[0] if isinstance(out, tuple) else out


def attend(q, k, v, mask: AttentionMask, window: int | None, backend: str, scale: float) -> torch.Tensor:
    """Causal attention. q [B, T, H, D], k and v [B, T, H_kv, D] -> [B, T, H, D].

    `backend` is a resolved name (see `resolve_backend`); `window` is None for full attention.
    """
    if backend == "flash_attn3":
        return flash_attn3(q, k, v, mask, window, scale)
    return kernel_attention(q, k, v, scale, backend, mask.kernel_mask(backend, window))
