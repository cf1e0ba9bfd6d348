"""Decode attention: the kernel that reads the cache for one new token per slot, and how it is chosen.

A decode step's attention is bound by the bytes of keys and values it reads. `sdpa` (every device) reads
each slot's first `span` cache positions (`cache.decode_span`, a shared bucket) behind a mask, gathering
the slots first unless they are 0..A-1. `triton` (CUDA, with the `triton` package) reads each slot's own
length only and nothing else, straight from the cache by slot index: split-K flash decoding, two launches
- split: program (slot row a, kv head, split s) takes the query heads of that kv head (GQA: the group's
  heads share one read of the keys and values), walks its chunk of the slot's first `length` entries in
  blocks, and keeps an online softmax (running max, sum and weighted values, float32);
- combine: program (a, query head) merges the splits' partial results.
Splits are chosen so that the launch has a few programs per SM even at batch 1; a split past a slot's length
returns at once. A sliding-window layer's ring holds a slot's last `window` positions in any order, which
attention does not care about (RoPE is in the keys), so its length is min(position + 1, window).

`choose(device, name)`: `auto` is `triton` on a CUDA device where the package imports, else `sdpa`. Both
compute softmax(q k^T * scale) v over the same entries; `triton` rounds the probabilities to the cache's dtype
before the second product (as flash attention kernels do), so bf16 results differ from `sdpa` by rounding
(tests/model/test_decode.py checks the kernel against SDPA on a GPU and in Triton's interpreter on CPU).
"""

from __future__ import annotations

import math
import os

import torch

from olmo_ds.model.decode import triton_decode as kernels

KERNELS = ("auto", "sdpa", "triton")
BLOCK_N = 64  # cache entries per inner block of the split kernel
PROGRAMS_PER_LAUNCH = 1024  # splits are added until the split launch has at least this many programs


def triton_available() -> bool:
    return kernels.AVAILABLE


def choose(device: torch.device, name: str = "auto") -> str:
    """The kernel a decode step runs on `device`: `name`, or for `auto` the fastest one that runs here."""
    if name not in KERNELS:
        raise ValueError(f"decode attention must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if name == "triton" and not triton_available():
        raise ValueError("decode attention 'triton' needs the triton package (pip install triton, or the project's gpu extra); "
                         "use 'sdpa'")
    if name == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(f"decode attention 'triton' runs on a CUDA device, not {device} (or under TRITON_INTERPRET=1); use 'sdpa'")
    return name


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def splits_for(rows: int, kv_heads: int, span: int) -> tuple[int, int]:
    """(splits, chunk): how a span of `span` entries is cut so that rows * kv_heads * splits programs fill the GPU."""
    blocks = max(1, -(-span // BLOCK_N))
    splits = min(blocks, max(1, -(-PROGRAMS_PER_LAUNCH // (rows * kv_heads))))
    chunk = -(-blocks // splits) * BLOCK_N
    return -(-span // chunk), chunk


def triton_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                  scale: float, span: int) -> torch.Tensor:
    """Attention of `q` [A, Hq, D] over cache slots `slots` [A] of `keys`/`values` [S, Hkv, N, D], each row over its
    slot's first `lengths[a]` entries (1 <= lengths <= span <= N). Returns [A, Hq, D] in q's dtype."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the triton decode kernel needs a power-of-two head_dim >= 16, got {dim}; use 'sdpa'")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the triton decode kernel needs the head dimension contiguous")
    group = heads // kv_heads
    splits, chunk = splits_for(rows, kv_heads, span)
    ms = torch.empty(rows, heads, splits, device=q.device, dtype=torch.float32)  # each split's running max,
    ls = torch.empty_like(ms)  # its sum of exponentials,
    accs = torch.empty(rows, heads, splits, dim, device=q.device, dtype=torch.float32)  # and its weighted values
    out = torch.empty_like(q)
    kernels.split_kernel[(rows, kv_heads, splits)](
        q, keys, values, slots, lengths, ms, ls, accs, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), scale * math.log2(math.e), splits, chunk, H=heads,
        G=group, GP=max(16, triton_next_pow2(group)), D=dim, BLOCK=BLOCK_N, IEEE=q.dtype == torch.float32,
        DYNAMIC=not _interpreting())
    kernels.combine_kernel[(rows, heads)](ms, ls, accs, out, out.stride(0), out.stride(1), splits, H=heads,
                                  SP=max(2, triton_next_pow2(splits)), D=dim)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
