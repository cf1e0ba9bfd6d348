"""The decode step's arithmetic compiled: on a GPU, a step's element-wise work fused by torch.compile.

Eagerly, a decode step of a 1B model launches ~700 kernels, most of them element-wise and tiny at a batch of
tokens: RoPE tables, QK-norms and RoPE, the output norm and residual, SwiGLU, the MLP's norm and residual, each a
few kernels. Inside a CUDA graph their launches are cheap, but each still costs a few microseconds of GPU time and a
round trip through memory. Here each block runs as two compiled functions of its weights around the cache's
attention:
- `qkv`: the q/k/v projections, QK-norm and RoPE (`model.block_math`'s first half);
- `rest`: the output projection, its norm and residual, SwiGLU, its norm and residual (the second half);
and the step's RoPE tables and the final norm and head are compiled too. The matmuls stay cuBLAS's (inductor's
default); what fuses is everything between them. q/k/v are one matmul, and gate/up another (`fused`: the model's
parameters become views of one weight each, so nothing is copied or refreshed): at a batch of one a step is
~15 small kernels a layer, each paying a few microseconds on top of its bytes, and these two take away three.

The step's new keys and values are written into the cache from `qkv` (`cache.write_decode` traced in: an indexed
store of the kernel that makes them, into the cache in place, as gpt-fast writes its static cache), where eagerly
they were a few kernels of their own. Attention itself stays outside (`SlotCache.attend(written=True)`: the Triton
decode kernel or SDPA), which is what makes one compile serve every step: the compiled functions' shapes depend only
on the step's rows (marked dynamic: one graph for every row bucket, and one of a single row, which dynamo
specialises) and the cache's slots and length (marked dynamic too: every decoder's cache), not on the span a step
reads or the kernel; the weights are arguments, so every layer shares the graphs (as the training model's
`block_math` does). Tracing the attention in (torch.compile can trace user Triton kernels) would bake the span's
split count into the graph: a graph per span bucket, for kernels a CUDA graph already launches for free. The engine
captures the whole step, compiled parts and attention alike, in its CUDA graphs (gpt-fast's way).

Used on CUDA only (`Decoder(compile=...)`, default on). Its numbers are the eager step's up to rounding (a fused
norm rounds once where the eager one rounds per kernel); the engine runs every GPU decode step, graphed or eager,
through the same path, so a run's tokens do not depend on whether a step was replayed. If a compiled function fails
on its first call (a compiler missing or failing on the host), the step runs eagerly from then on, after one
line on stderr; a failure after that is an error.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from olmo_ds.model.decode.cache import write_decode
from olmo_ds.model.model import OLMo, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


def _qkv(x, cos, sin, w_qkv, gq, gk, keys, values, slots, positions, *, eps: float, n_heads: int, n_kv_heads: int,
         ring: int | None):
    b, t, _ = x.shape
    head_dim = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    q, k, v = F.linear(x, w_qkv).split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = rms_norm(q, gq, eps).view(b, t, n_heads, head_dim)
    k = apply_rope(rms_norm(k, gk, eps).view(b, t, n_kv_heads, head_dim), cos, sin)
    v = v.reshape(b, t, n_kv_heads, head_dim)
    write_decode(keys, values, slots, positions, ring, k, v)
    return apply_rope(q, cos, sin), k, v


def _rest(x, out, wo, g_attn, w_gate_up, w_down, g_mlp, *, eps: float):
    x = x + rms_norm(F.linear(out.reshape(*x.shape[:2], -1), wo), g_attn, eps)
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return x + rms_norm(F.linear(F.silu(gate) * up, w_down), g_mlp, eps)


def _logits(x, g, w, *, eps: float):
    return F.linear(rms_norm(x, g, eps), w)


@functools.cache
def _compiled() -> dict:
    """The compiled functions, one set per process: every decoder and every layer share their graphs."""
    return {f.__name__: torch.compile(f, dynamic=None) for f in (_qkv, _rest, _logits, rope_cos_sin)}


@torch.no_grad()
def fused(*params: torch.nn.Parameter) -> torch.Tensor | None:
    """One weight holding `params` end to end along their output rows, each parameter now a view of its own rows:
    a decode step multiplies by all of them at once (q/k/v, gate/up), one matmul where there were several, and
    whatever writes a parameter in place (`Decoder.load_weights`, RL's `gather_into`, a `load_state_dict`) writes the
    fused weight too: no copy to keep fresh, no memory spent. Parameters already laid out so (a decoder built on this
    model before) are viewed as they are. None for parameters that are views of memory someone else lays out (an
    optimizer's flat buffer, a ZeRO partition): those are left alone, and the step joins them per call."""
    first, rows = params[0], sum(p.shape[0] for p in params)
    at, adjacent = first.storage_offset(), True
    for p in params:
        adjacent = adjacent and p.is_contiguous() and p.storage_offset() == at and \
            p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        at += p.numel()
    if adjacent:
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    if any(hasattr(p, "ds_id") or p.storage_offset() or p.untyped_storage().nbytes() != p.numel() * p.element_size() for p in params):
        return None  # not each parameter's own memory
    weight = torch.cat([p.detach() for p in params])
    at = 0
    for p in params:
        p.data = weight[at:at + p.shape[0]]
        at += p.shape[0]
    return weight


def _dynamic_rows(*tensors: torch.Tensor) -> None:
    """Mark the rows dimension dynamic, so the first graph already serves every bucket (a single row aside)."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class CompiledStep:
    """A decode step's forward (`forward`) through the compiled functions, for one model; `enabled` turns False
    (for good) if a compiled function fails on its first call."""

    def __init__(self, model: OLMo):
        self.model = model
        self.enabled, self.proven = True, False
        cfg = model.cfg
        # Per block, q/k/v and gate/up as one weight each (`fused`: the model's parameters become views of them)
        self.weights = [(fused(b.attn.q_proj.weight, b.attn.k_proj.weight, b.attn.v_proj.weight),
                         fused(b.mlp.gate_proj.weight, b.mlp.up_proj.weight)) for b in model.blocks]
        # RoPE's inverse frequencies per layer kind, computed once (the eager forward recomputes them every step)
        self.rope = {}
        for sliding in {cfg.layer_is_sliding(i) for i in range(cfg.n_layers)}:
            theta, yarn = cfg.rope_for(sliding)
            self.rope[sliding] = rope_inv_freq(cfg.head_dim, theta, yarn, device=next(model.parameters()).device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor | None:
        """Logits [B, padded_vocab] of a decode step (ids, positions [B, 1]) over `cache`, or None when the compiled
        step is off (the caller runs the eager forward)."""
        if not self.enabled:
            return None
        try:
            with torch.no_grad():
                out = self._forward(ids, positions, cache)
        except Exception as e:  # noqa: BLE001 - the compiler's errors are of many kinds
            if self.proven:
                raise
            self.enabled = False
            print(f"generate: the compiled decode step failed ({type(e).__name__}: {str(e)[:300]}); decoding with the eager "
                  f"step", file=sys.stderr, flush=True)
            return None
        self.proven = True
        return out

    def _forward(self, ids, positions, cache) -> torch.Tensor:
        model, fn = self.model, _compiled()
        cfg = model.cfg
        x = model.embed(ids)
        _dynamic_rows(x, positions)
        tables = {}
        for sliding, (inv_freq, scale) in self.rope.items():
            tables[sliding] = fn["rope_cos_sin"](positions, inv_freq, scale)
            _dynamic_rows(*tables[sliding])
        for i, block in enumerate(model.blocks):
            a, m = block.attn, block.mlp
            cos, sin = tables[cfg.layer_is_sliding(i)]
            _dynamic_rows(x)
            w_qkv, w_gate_up = self.weights[i]
            if w_qkv is None:  # parameters in someone else's layout (`fused`)
                w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            if w_gate_up is None:
                w_gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            keys, values, slots, where, ring = cache.decode_writes(i)
            _dynamic_rows(slots, where)
            for t in (keys, values):  # any decoder's cache (slots, length) through one graph
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
            q, k, v = fn["_qkv"](x, cos, sin, w_qkv, a.q_norm.weight, a.k_norm.weight, keys, values, slots, where,
                                 eps=a.q_norm.eps, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, ring=ring)
            out = cache.attend(i, q, k, v, a.window, a.head_dim ** -0.5, written=True)
            _dynamic_rows(x, out)
            x = fn["_rest"](x, out, a.o_proj.weight, block.attn_norm.weight, w_gate_up, m.down_proj.weight, block.mlp_norm.weight,
                            eps=block.attn_norm.eps)
        hidden = x.reshape(-1, x.shape[-1])
        _dynamic_rows(hidden)
        return fn["_logits"](hidden, model.norm.weight, model.head.weight, eps=model.norm.eps)
