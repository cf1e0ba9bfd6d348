"""The OLMo-2 / OLMo-3 decoder, written to match transformers' Olmo2ForCausalLM / Olmo3ForCausalLM.

Per block (OLMo 2's "reordered norm"): x = x + norm(attn(x)); x = x + norm(mlp(x)) — the RMSNorms sit
on the sublayer outputs, there is no input norm. Attention projects q, k, v without biases, applies
QK-norm (an RMSNorm over the whole projected q and the whole projected k, before splitting heads),
then RoPE (theta 500k, computed in fp32), then causal attention with grouped-query heads. The MLP is
SwiGLU. OLMo 3 adds sliding-window attention on a repeating layer pattern (the last layer always
full) and YaRN RoPE scaling on the full-attention layers only.

ZeRO-3 notes: DeepSpeed gathers a module's parameters only while that module's own forward runs, so
every parameter is used inside the forward of the module that owns it (the loss runs inside `LMHead`),
and weights are initialised inside each leaf module's `__init__` (via `reset_parameters`) so that
`deepspeed.zero.Init` partitions initialised tensors. RoPE tables are computed in the forward, in
fp32, so zero.Init's dtype casting of tensors created at construction cannot touch them.

Compiled blocks (`ModelConfig.compile`): a block can run as one `torch.compile`d function of its
weights (`block_math`, the same math as the modules, written over the same helpers). It is taken only
where it is exactly the eager block, and only in training (gradients enabled) or in a scoring forward
(`score=`, evaluation; its callers keep to a few batch shapes, each one static-shape graph): attention through
flex_attention or an SDPA backend, with sliding windows and document masks passed in as the mask the
kernel takes (a flex BlockMask built once per forward and window, shared by the layers), no KV cache,
and every weight of the block already gathered, which under ZeRO-3 the trainer guarantees by making
each block a leaf module (the block's own hooks gather all its weights; the skipped submodule forwards
would otherwise be the ones that gather them). Anything else (flash-attn backends, generation, a
no-grad forward for logits) runs the modules eagerly. `BLOCK_CALLS` counts which way each block call went.

One compiled function serves every layer and every row shape (`_RowShapedCompile`): rows of any length and
micro-batch (RL's, SFT's, DPO's) cost at most 3 graphs per kind of call, not one per shape, and no graph
depends on which layer's weights it got. The choices, measured on CPU under real ZeRO-3 with torch 2.11 (the GPU
machine's) and 2.13 (tests/model/test_compile_zero3.py; not yet on a GPU):
- Layers. The per-layer graphs came from DeepSpeed, not from the weights: with `memory_efficient_linear` on,
  `torch.nn.functional.linear` is DeepSpeed's autograd function, whose backward asks `hasattr(weight, "ds_id")`,
  and dynamo 2.11 guards on the value (`wk.ds_id == 79`): a graph per layer, and past dynamo's recompile limit
  (8) the remaining calls ran eagerly. `block_math` calls torch's own linear (`_linear`), so no graph reads a
  parameter's attributes, whatever the DeepSpeed config; a block compiles only as a ZeRO-3 leaf, whose hooks
  gather its weights for the backward, the one thing DeepSpeed's function was there to do. Not taken: plain
  tensors for the weights (a view keeps the gathered storage alive after ZeRO-3 releases the weight, since the
  graph saves it for backward; `.data` loses the gradient); a guard filter dropping the `ds_id` guards (DeepSpeed's
  backward would stay traced as it looked at compile time); a compiled function per block, or DeepSpeed's
  DeepCompile, whose guards since PR #8328 name each parameter's `ds_id` and `ds_shape` (a graph per layer either
  way, each compiled apart).
- Shapes. A static graph for the first rows' shape (what a fixed-shape run such as pretraining compiles, and
  what its measurements are of), then dynamic rows. Not taken: `dynamic=False` (a graph per shape: 8 shapes and
  the blocks ran eagerly); dynamic from the start (every run on dynamic-shape kernels); bucketing (padded rows
  cost compute); a higher `recompile_limit` (a compile per shape and layer, and a wall further on).

FP8 (`ModelConfig.float8`): the block's seven matmuls go through `olmo_ds.model.float8.linear` on both
paths (`block_math` and the eager `Linear` modules) in forwards with gradients enabled; `BLOCK_CALLS`
counts them as `float8_matmuls` (forward matmuls; each has two FP8 matmuls in backward). The LM head,
the embedding and every no-grad forward keep the training dtype.

Activation checkpointing (`ModelConfig.activation_checkpointing`) recomputes a chosen subset of blocks
in the backward pass: all of them, or every k-th (`ModelConfig.checkpoints_block`).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from olmo_ds.model import float8 as fp8
from olmo_ds.model.attention import _SDPA_KERNELS, AttentionMask, attend, kernel_attention, resolve_backend
from olmo_ds.model.config import ModelConfig, YarnConfig
from olmo_ds.model.loss import CHUNK_SIZE, document_logprobs, fused_linear_cross_entropy
from olmo_ds.model.masking import document_ids
from olmo_ds.model.sequence_parallel import SequenceParallel, ulysses_attention

log = logging.getLogger("olmo_ds")


class ModelOutput(NamedTuple):
    """`loss` = ce_loss + z_loss is the value to backpropagate; `ce_loss` and `z_loss` are detached metrics."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    z_loss: torch.Tensor


class DocumentLogprobs(NamedTuple):
    """What a forward with `per_document=True` returns (preference tuning), one entry per `doc_lens` entry."""

    logprob: torch.Tensor  # float32 [B, D]: the summed log-probability of document d's labels in row b (differentiable)
    tokens: torch.Tensor  # int64 [B, D]: how many labels document d of row b has


class Scores(NamedTuple):
    """What a scoring forward (`OLMo.forward(score=(index, targets))`) returns, one entry per target."""

    logprob: torch.Tensor  # float32 [N]: log p(targets[n] | the tokens position index[n] sees)
    greedy: torch.Tensor  # bool [N]: targets[n] is the arg-max of that distribution


# Positions per chunk of the head's scoring: 4096 x 100,352 float32 logits = 1.6 GB at most.
SCORE_CHUNK = 4096


def _score_chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and whether each is the arg-max, for one chunk of positions: logits in the
    weight's dtype, their softmax in float32, as the logits path (`olmo_ds.eval.scoring.target_logprobs`)."""
    logits = F.linear(hidden, weight).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1), logits.argmax(-1) == targets


@functools.cache
def _compiled_score_chunk():
    """`_score_chunk` compiled: the float32 cast, logsumexp, gather and arg-max read the chunk's logits once
    instead of writing and re-reading float32 copies (an eighth of a 1B model's forward, eagerly)."""
    return torch.compile(_score_chunk, dynamic=False)


def score_targets(hidden: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, targets: torch.Tensor,
                  compiled: bool = False, chunk_size: int = SCORE_CHUNK) -> Scores:
    """`Scores` of `targets` [N] at the flat positions `index` [N] of `hidden` [..., d] under the head
    `weight` [V, d]. Only those positions go through the head (a position may appear more than once),
    a chunk at a time. `compiled`: through `_compiled_score_chunk`, every chunk padded to one of a few
    sizes (powers of two from 256 to `chunk_size`), so a handful of graphs serve any N."""
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    n = h.shape[0]
    size = min(chunk_size, max(256, 1 << max(0, n - 1).bit_length())) if compiled else chunk_size
    fn = _compiled_score_chunk() if compiled else _score_chunk
    logprob, greedy = [], []
    for start in range(0, n, size):
        part_h, part_t = h[start:start + size], targets[start:start + size]
        if compiled and part_h.shape[0] < size:  # padding rows score target 0 and are dropped
            pad = size - part_h.shape[0]
            part_h = torch.cat([part_h, part_h.new_zeros(pad, part_h.shape[1])])
            part_t = torch.cat([part_t, part_t.new_zeros(pad)])
        lp, top = fn(part_h, weight, part_t)
        logprob.append(lp[:min(size, n - start)])
        greedy.append(top[:min(size, n - start)])
    if not logprob:
        return Scores(torch.zeros(0, device=hidden.device), torch.zeros(0, dtype=torch.bool, device=hidden.device))
    return Scores(torch.cat(logprob), torch.cat(greedy))


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Truncated normal at +-3 std, drawn in fp32 whatever the parameter dtype."""
    with torch.no_grad():
        values = torch.empty_like(weight, dtype=torch.float32)
        nn.init.trunc_normal_(values, mean=0.0, std=std, a=-3 * std, b=3 * std)
        weight.copy_(values)


class Linear(nn.Linear):
    """Bias-free linear layer initialised with OLMo's truncated normal; a block's matmuls in FP8 while
    training when `float8` names a recipe (see `olmo_ds.model.float8`)."""

    def __init__(self, in_features: int, out_features: int, init_std: float, float8: str = "off"):
        self.init_std = init_std
        super().__init__(in_features, out_features, bias=False)
        self.float8 = float8

    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.float8 if torch.is_grad_enabled() else "off"
        if recipe == "off":
            return super().forward(x)
        fp8.prepare(recipe)
        BLOCK_CALLS["float8_matmuls"] += 1
        return fp8.linear(x, self.weight, recipe)


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, dim: int, init_std: float):
        self.init_std = init_std
        super().__init__(num_embeddings, dim)

    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, self.init_std)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, scaled by the weight, cast back to the input dtype (as transformers)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # one fused kernel where available
    return (weight * normed).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, yarn: YarnConfig | None, device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, with YaRN's per-dimension interpolation if given.

    Mirrors transformers' `_compute_default_rope_parameters` / `_compute_yarn_parameters` (truncated
    correction range) so logits agree with the exported model.
    """
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, yarn.attention_factor


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin tables [..., head_dim] for integer `positions` [...] (elementwise: a position's
    entries are the same whatever else is in `positions`)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] (rotate-half convention, in fp32) and cast back to x's dtype; cos and sin
    are [T, D] (one table for the batch) or [B, T, D] (each row its own positions)."""
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None, :], sin[:, :, None, :])
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache:
    """Keys and values of past positions for rows that all stand at the same position (scoring shared
    contexts, `olmo_ds.eval.loglikelihood`). A cache owns its attention (`attend`): the attention layer
    hands it the new queries, keys and values, so a cache of another layout (generation's per-sequence
    slots and sliding-window rings, `olmo_ds.model.decode.cache.SlotCache`) runs through the same blocks."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.pos + k.shape[1]
        self.keys[layer][:, self.pos:end] = k
        self.values[layer][:, self.pos:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def attend(self, layer: int, q, k, v, window: int | None, scale: float) -> torch.Tensor:
        """Causal attention of q [B, T, H, D] over the cached positions and the new k, v [B, T, H_kv, D]."""
        keys, values = self.update(layer, k, v)
        q_pos = torch.arange(self.pos, self.pos + q.shape[1], device=q.device)[:, None]
        k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed = allowed & (k_pos > q_pos - window)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=allowed, scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


@functools.cache
def _resolved_backend(name: str, device: torch.device, needs_mask: bool, tree: bool = False) -> str:
    return resolve_backend(name, device, needs_mask, tree)


# Resolved attention backends that `block_math` runs (through `attention.kernel_attention`): flex and
# SDPA take their masks as tensors (a BlockMask, a boolean matrix); flash-attn's varlen form takes
# per-batch lengths and counts that a static-shape graph would recompile for, so it stays eager.
_COMPILED_BACKENDS = frozenset({"sdpa", "sdpa_cudnn_first", *_SDPA_KERNELS, "flex"})


def block_math(x, cos, sin, wq, wk, wv, wo, gq, gk, g_attn, w_gate, w_up, w_down, g_mlp, *,
               eps: float, n_heads: int, n_kv_heads: int, backend: str, kernel_mask=None, float8: str = "off",
               sp_group: str | None = None, sp_size: int = 1) -> torch.Tensor:
    """One block as a function of its weights (the compiled path).

    The same operations as `Block`'s modules in the same order: q/k/v projections, QK-norm over the
    whole projections, RoPE, attention, output projection and its norm, residual; SwiGLU, its norm,
    residual. Keeping the weights as arguments lets torch.compile fuse across the whole block while
    ZeRO-3 stays in charge of gathering them (the block's hooks run around this call). `kernel_mask`
    is `AttentionMask.kernel_mask`: None (plain causal), a flex BlockMask or SDPA's boolean mask,
    built once per forward and passed in, so one graph per mask kind serves every batch and layer.
    `float8` is the FP8 recipe of the seven matmuls (`olmo_ds.model.float8.linear`; "off": the weights' dtype),
    a constant of the graph: each recipe gets its own. `sp_group`, `sp_size`: sequence parallelism (x holds this
    rank's slice of every row; attention runs over whole rows through `sequence_parallel.ulysses_attention`, whose
    all-to-alls are operators the graph keeps), the group's name and size, constants of the graph too.
    """
    b, t, _ = x.shape
    head_dim = wq.shape[0] // n_heads
    q = rms_norm(_linear(x, wq, float8), gq, eps).view(b, t, n_heads, head_dim)
    k = rms_norm(_linear(x, wk, float8), gk, eps).view(b, t, n_kv_heads, head_dim)
    v = _linear(x, wv, float8).view(b, t, n_kv_heads, head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if sp_group is not None:
        out = ulysses_attention(q, k, v, sp_group, sp_size,
                                lambda q, k, v: kernel_attention(q, k, v, head_dim ** -0.5, backend, kernel_mask))
    else:
        out = kernel_attention(q, k, v, head_dim ** -0.5, backend, kernel_mask)
    x = x + rms_norm(_linear(out.reshape(b, t, -1), wo, float8), g_attn, eps)
    return x + rms_norm(_linear(F.silu(_linear(x, w_gate, float8)) * _linear(x, w_up, float8), w_down, float8), g_mlp, eps)


def _linear(x: torch.Tensor, weight: torch.Tensor, float8: str) -> torch.Tensor:
    """`block_math`'s matmul: torch's own linear (`torch._C._nn.linear`, what `F.linear` is until something replaces
    it), not whatever `torch.nn.functional.linear` is now. `deepspeed.zero.Init` with `memory_efficient_linear`
    (DeepSpeed's default) replaces it process-wide with its own autograd function, whose backward asks each weight
    `hasattr(weight, "ds_id")`: dynamo (torch 2.11) then guards on every layer's `ds_id`, so 16 layers are 16 graphs
    and past the recompile limit the blocks run eagerly. Inside a leaf block the block's hooks gather its weights
    for the backward too, so that function has nothing to do here. FP8 recipes go through `float8.linear`."""
    return torch._C._nn.linear(x, weight) if float8 == "off" else fp8.linear(x, weight, float8)


class _RowShapedCompile:
    """`fn` compiled once for every row shape: the first rows' shape gets a static-shape graph (a run that keeps to
    one shape, as pretraining does, runs exactly that), and from the first other shape on, the rows' batch and
    length dimensions of `x` are marked dynamic together, so one more graph serves every later shape (torch
    specialises a batch of 1 apart: one graph more). The weights' shapes stay static (torch's default for
    parameters). So a function holds at most 3 graphs per kind of call (attention backend, mask kind, FP8 recipe,
    sequence parallelism), and a run makes at most 2 kinds (full and sliding-window layers): 6, under dynamo's
    `recompile_limit` of 8, whatever the rows' shapes. Left to itself (`dynamic=None`), dynamo would mark a
    dimension dynamic only once it changed: the length first, then the batch, one graph each.

    Should dynamo still reach its recompile limit (a kind of call this class does not foresee), it is told to fail
    instead of silently running the frame eagerly behind a compiled name: the function is then called eagerly from
    here on, counted as such in `BLOCK_CALLS` ("eager", and "compile_fallbacks" once), with one warning."""

    def __init__(self, fn):
        self.eager_fn, self.fn = fn, torch.compile(fn, dynamic=None)
        self.first_shape: tuple[int, int] | None = None
        self.exhausted = False  # dynamo hit its recompile limit: eager from then on

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.exhausted:
            BLOCK_CALLS["eager"] += 1
            return self.eager_fn(x, *args, **kwargs)
        shape = tuple(x.shape[:2])
        if self.first_shape is None:
            self.first_shape = shape
        elif shape != self.first_shape:
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(x, 1)
        BLOCK_CALLS["compiled"] += 1  # before the call: a recomputation under activation checkpointing may end inside it
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                return self.fn(x, *args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self.exhausted = True
            BLOCK_CALLS["compiled"] -= 1
            BLOCK_CALLS["compile_fallbacks"] += 1
            log.warning("compiled blocks: torch.compile reached its recompile limit (%d graphs of %s); the blocks run eagerly "
                        "from here on (TORCH_LOGS=recompiles says why)", torch._dynamo.config.recompile_limit, self.eager_fn.__name__)
            return self(x, *args, **kwargs)


@functools.cache
def _compiled_block_math() -> _RowShapedCompile:
    """One compiled `block_math` per process, built on first use, that every layer shares (the weights are
    arguments, and nothing in the graph reads a ZeRO-3 parameter's attributes: `_linear`)."""
    return _RowShapedCompile(block_math)


def _scoring_block_math(*args, **kwargs) -> torch.Tensor:
    return block_math(*args, **kwargs)


@functools.cache
def _compiled_scoring_block_math() -> _RowShapedCompile:
    """`block_math` compiled for no-grad scoring forwards, through a function of its own: torch.compile
    keeps its graphs and its recompile limit per function, so scoring's shapes never crowd out training's."""
    return _RowShapedCompile(_scoring_block_math)


# How each block call ran ("compiled" or "eager"); recomputation under activation checkpointing counts
# again. Reports read it to show whether the compiled path was taken.
BLOCK_CALLS: collections.Counter = collections.Counter()


def _weights_ready(block: nn.Module, params) -> bool:
    """Whether a compiled block may take these weights: plain tensors, or ZeRO-3 parameters that are all gathered
    (AVAILABLE) in a block that is a ZeRO-3 leaf module. Only a leaf block's own hooks gather all its weights, for
    the backward as for the forward; otherwise each submodule's hooks gather its own, and the compiled function
    calls no submodule, so its backward could find a weight partitioned."""
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):
        return True
    from deepspeed.utils import z3_leaf_module

    return z3_leaf_module(block) and all(p.ds_status.name == "AVAILABLE" for p in params)


def make_blocks_zero3_leaves(model: nn.Module) -> None:
    """Make every `Block` of `model` a ZeRO-3 leaf module (`deepspeed.utils.set_z3_leaf_modules`), as compiled blocks
    under ZeRO-3 need (`_weights_ready`): the block's own hooks then gather all its weights, before its forward and
    again before its backward, and release them after; weights stay partitioned between blocks. Call it after
    building the model under `deepspeed.zero.Init` and before `deepspeed.initialize`."""
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [Block])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.backend = cfg.attention_backend
        self.window = cfg.sliding_window if cfg.layer_is_sliding(layer) else None
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.d_model, q_dim, cfg.init_std, cfg.float8)
        self.k_proj = Linear(cfg.d_model, kv_dim, cfg.init_std, cfg.float8)
        self.v_proj = Linear(cfg.d_model, kv_dim, cfg.init_std, cfg.float8)
        self.o_proj = Linear(q_dim, cfg.d_model, cfg.init_std, cfg.float8)
        self.q_norm = RMSNorm(q_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(kv_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask: AttentionMask | None, cache: KVCache | None = None,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, t, self.n_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = self.head_dim ** -0.5
        if cache is None:
            needs_mask = self.window is not None or mask.has_documents
            backend = _resolved_backend(self.backend, x.device, needs_mask, mask.has_branches)
            if sp is not None:  # `mask` is of whole rows, as the attention behind the exchange sees them
                out = ulysses_attention(q, k, v, sp.name, sp.size, lambda q, k, v: attend(q, k, v, mask, self.window, backend, scale))
            else:
                out = attend(q, k, v, mask, self.window, backend, scale)
        else:
            out = cache.attend(self.layer, q, k, v, self.window, scale)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.mlp_hidden, cfg.init_std, cfg.float8)
        self.up_proj = Linear(cfg.d_model, cfg.mlp_hidden, cfg.init_std, cfg.float8)
        self.down_proj = Linear(cfg.mlp_hidden, cfg.d_model, cfg.init_std, cfg.float8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def weights(self) -> tuple[torch.Tensor, ...]:
        """The block's weights in `block_math`'s argument order."""
        a, m = self.attn, self.mlp
        return (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, a.q_norm.weight, a.k_norm.weight,
                self.attn_norm.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, self.mlp_norm.weight)

    def _compiled_attention(self, x, mask: AttentionMask | None, cache: KVCache | None):
        """(backend, kernel mask) for the compiled path, or None where this call must run eagerly."""
        if cache is not None or mask is None:
            return None
        if not torch.is_grad_enabled() and not mask.static_shapes:
            # Other no-grad forwards (the exact-length scoring path, a transformers-style call for logits) stay
            # eager; scoring, per-document and packed-row forwards (evaluation, DPO's reference, RL's old-policy
            # and reference log-probabilities) opt in through the mask. Generation has a KV cache.
            return None
        if not self.cfg.compiles_blocks(x.device.type):
            return None
        window = self.attn.window
        backend = _resolved_backend(self.attn.backend, x.device, window is not None or mask.has_documents, mask.has_branches)
        if backend not in _COMPILED_BACKENDS or not _weights_ready(self, self.weights()):
            return None
        return backend, mask.kernel_mask(backend, window)

    def forward(self, x, cos, sin, mask: AttentionMask | None, cache: KVCache | None = None,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        route = self._compiled_attention(x, mask, cache)
        if route is not None:  # counted in BLOCK_CALLS by the compiled function (`_RowShapedCompile`)
            backend, kernel_mask = route
            recipe = self.cfg.float8 if torch.is_grad_enabled() else "off"
            if recipe != "off":
                fp8.prepare(recipe)  # outside the compiled function: imports, configs, torchao's inductor guard
                BLOCK_CALLS["float8_matmuls"] += fp8.MATMULS_PER_BLOCK
            fn = _compiled_block_math() if torch.is_grad_enabled() else _compiled_scoring_block_math()
            return fn(x, cos, sin, *self.weights(), eps=self.attn_norm.eps, n_heads=self.attn.n_heads,
                      n_kv_heads=self.attn.n_kv_heads, backend=backend, kernel_mask=kernel_mask, float8=recipe,
                      sp_group=sp.name if sp else None, sp_size=sp.size if sp else 1)
        BLOCK_CALLS["eager"] += 1
        x = x + self.attn_norm(self.attn(x, cos, sin, mask, cache, sp))
        return x + self.mlp_norm(self.mlp(x))


class LMHead(nn.Module):
    """The output projection, and the loss computed inside it so ZeRO-3 has gathered its weight."""

    def __init__(self, d_model: int, vocab: int, init_std: float, tied: nn.Parameter | None = None):
        super().__init__()
        if tied is not None:
            self.weight = tied
        else:
            self.weight = nn.Parameter(torch.empty(vocab, d_model))
            _trunc_normal_(self.weight, init_std)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, z_loss_coef: float = 0.0,
                chunk_size: int = CHUNK_SIZE, score: tuple[torch.Tensor, torch.Tensor] | None = None, compiled: bool = False,
                divisor: float | torch.Tensor | None = None, documents: tuple[torch.Tensor, int] | None = None):
        if score is not None:
            return score_targets(hidden, self.weight, *score, compiled=compiled)
        if labels is None:
            return F.linear(hidden, self.weight)
        if documents is not None:  # ([B, T] each position's document index within its row, D documents a row)
            documents, d = documents
            b = documents.shape[0]
            flat = documents.long() + torch.arange(b, device=documents.device)[:, None] * d
            logprob, tokens = document_logprobs(hidden, self.weight, labels, flat, b * d, chunk_size)
            return DocumentLogprobs(logprob.view(b, d), tokens.view(b, d))
        return ModelOutput(*fused_linear_cross_entropy(hidden, self.weight, labels, z_loss_coef, chunk_size, divisor=divisor))


class OLMo(nn.Module):
    """OLMo-2 / OLMo-3 causal language model.

    `forward(input_ids, labels=None, doc_lens=None, z_loss_coef=0.0)` returns logits
    [B, T, padded_vocab] when `labels` is None, else a `ModelOutput`. `doc_lens` ([B, max_docs],
    zero-padded, rows summing to T) restricts attention to each packed document. `loss_divisor`: the
    loss is the sum over the targets divided by it rather than their mean (fine-tuning's step token
    mean, `olmo_ds.model.loss.token_mean_divisor`); None (pretraining) leaves the loss as it was.

    Scoring (evaluation, `olmo_ds.eval`): `score=(index, targets)`, int64 [N] each, returns `Scores`:
    the log-prob and arg-max test of `targets[n]` at flat position `index[n]` (b * T + t) only, the head
    run on those positions alone, no [B, T, V] logits. Scoring callers keep to a few batch shapes, so
    its forwards run compiled blocks where training would (`ModelConfig.compile`), under no_grad too.
    With it, `branches` and `positions` ([B, T] each; see `attention.AttentionMask`) let the branches of
    a document (continuations) share its prefix (their context) in one row.

    Sequence parallelism (training): `sequence_parallel=SequenceParallel(...)` (`olmo_ds.model.sequence_parallel`)
    makes `input_ids` and `labels` this rank's slice [B, T/N] of each row, while `doc_lens` and `positions` still
    describe whole rows ([B, T]): the masks are those of the whole rows, RoPE takes this slice's positions, and the
    loss (over `loss_divisor`) is this slice's share of the step's.

    Preference tuning: `per_document=True` (with `labels` and `doc_lens`) returns `DocumentLogprobs`, each packed
    document's summed label log-probability (differentiable) and label count, [B, D] in `doc_lens`' layout,
    instead of the loss (`olmo_ds.model.loss.document_logprobs`: the head on the labelled positions only).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.padded_vocab_size, cfg.d_model, cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        tied = self.embed.weight if cfg.tie_embeddings else None
        self.head = LMHead(cfg.d_model, cfg.padded_vocab_size, cfg.init_std, tied=tied)
        # RoPE tables of whole-sequence forwards, by (length, device): not state (no buffer, nothing to
        # partition or save), only the ~15 small kernels and their launches that every forward repeated.
        self._rope_cache: dict[tuple[int, torch.device], dict] = {}

    def _rope_tables(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin per layer kind (keyed by `is_sliding`), each with its own base and scaling (`ModelConfig.rope_for`)."""
        cfg, tables = self.cfg, {}
        for sliding in {cfg.layer_is_sliding(i) for i in range(cfg.n_layers)}:
            theta, yarn = cfg.rope_for(sliding)
            inv_freq, scale = rope_inv_freq(cfg.head_dim, theta, yarn, device=positions.device)
            tables[sliding] = rope_cos_sin(positions, inv_freq, scale)
        return tables

    def _cached_rope_tables(self, t: int, device: torch.device) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """`_rope_tables` of positions 0..t-1, computed once per length and device. Built as ordinary
        tensors even under inference_mode, so that a table first made in evaluation serves training."""
        key = (t, device)
        if key not in self._rope_cache:
            if len(self._rope_cache) >= 4:  # a few lengths (train, eval, ...) at most; prompts vary
                self._rope_cache.clear()
            with torch.inference_mode(False), torch.no_grad():
                self._rope_cache[key] = self._rope_tables(torch.arange(t, device=device))
        return self._rope_cache[key]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_lens: torch.Tensor | None = None, z_loss_coef: float = 0.0, cache: KVCache | None = None, *,
                positions: torch.Tensor | None = None, branches: torch.Tensor | None = None,
                score: tuple[torch.Tensor, torch.Tensor] | None = None, loss_divisor: float | torch.Tensor | None = None,
                sequence_parallel: SequenceParallel | None = None, per_document: bool = False):
        sp = sequence_parallel
        b, t = input_ids.shape
        row = t * sp.size if sp else t  # the whole row's length; this rank holds `t` of it
        start = cache.pos if cache is not None else 0
        if cache is not None and (doc_lens is not None or positions is not None or branches is not None or score is not None):
            raise ValueError("doc_lens, positions, branches and score are not supported with a KV cache")
        if sp is not None and (cache is not None or branches is not None or score is not None):
            raise ValueError("sequence parallelism is for training forwards: no KV cache, branches or score")
        if score is not None and labels is not None:
            raise ValueError("pass labels (training loss) or score (evaluation), not both")
        if per_document and (labels is None or doc_lens is None or sp is not None):
            raise ValueError("per_document needs labels and doc_lens, and no sequence parallelism (a document's sum needs its whole row)")
        # RoPE would extrapolate past what the model was built for; refuse rather than degrade silently.
        if positions is None and start + row > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + row} tokens exceeds model.max_seq_len {self.cfg.max_seq_len}")
        if positions is not None and int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is beyond model.max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(input_ids)
        if cache is not None:
            tables = self._rope_tables(torch.arange(start, start + t, device=input_ids.device))
        elif positions is None:
            tables = self._cached_rope_tables(row, input_ids.device)
            if sp is not None:
                tables = {kind: (sp.local(cos, 0), sp.local(sin, 0)) for kind, (cos, sin) in tables.items()}
        else:  # rows of the tables of 0..max_seq_len-1, the same values a whole-sequence forward uses
            full = self._cached_rope_tables(self.cfg.max_seq_len, input_ids.device)
            positions = positions.to(input_ids.device)
            mine = sp.local(positions) if sp is not None else positions
            tables = {kind: (cos[mine], sin[mine]) for kind, (cos, sin) in full.items()}
        mask = None
        if cache is None:
            # Scoring, per-document and packed-row forwards keep to a few batch shapes (the loader's rows, RL's packed
            # samples), so their no-grad forwards (evaluation, DPO's reference pass, RL's old-policy and reference
            # log-probabilities) may run compiled blocks too.
            mask = AttentionMask(b, row, input_ids.device, doc_lens, branches, positions,
                                 static_shapes=score is not None or per_document or doc_lens is not None)
        checkpointing = torch.is_grad_enabled() and cache is None
        for i, block in enumerate(self.blocks):
            cos, sin = tables[self.cfg.layer_is_sliding(i)]
            if checkpointing and self.cfg.checkpoints_block(i):
                x = checkpoint(block, x, cos, sin, mask, None, sp, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, cache, sp)
        if cache is not None:
            cache.pos += t
        x = self.norm(x)
        if score is not None:
            return self.head(x, score=score, compiled=self.cfg.compiles_blocks(x.device.type))
        if per_document:
            return self.head(x, labels, documents=(document_ids(doc_lens.to(x.device), t), doc_lens.shape[1]))
        return self.head(x, labels, z_loss_coef, divisor=loss_divisor)


def build_model(cfg: ModelConfig) -> OLMo:
    return OLMo(cfg)
