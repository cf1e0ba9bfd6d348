"""FP8 matmuls for the blocks' linear layers (`ModelConfig.float8`), through torchao's float8 training casts.

Why a function rather than torchao's module swap (`convert_to_float8_training`): a compiled block runs
`block_math` over the raw weights ZeRO-3 has gathered for it, so the `nn.Linear` modules a swap would
replace never run there. `linear(x, weight, recipe)` is called by `block_math` for the block's seven
matmuls (q, k, v, o projections; gate, up, down) and by the eager `Linear` modules alike, so both
paths compute the same thing and ZeRO-3 keeps gathering and releasing the weights as before.

What runs in FP8: those seven matmuls and, in backward, their two matmuls each (input gradient, weight
gradient), with dynamic scaling: every operand is scaled by its own absolute maximum at every call
(`tensorwise`: one scale per tensor, e5m2 for output gradients; `rowwise`: one power-of-two scale per row,
e4m3 throughout), torchao's recipes of those names. There is no scale state (no amax history, no buffers):
parameters, optimizer state and checkpoints are exactly a bf16 run's, which is why `float8` is an execution
field (a run resumes under another value). What stays in the training dtype: the LM head and its loss
(torchao's recipes leave the output layer in high precision too: its logits feed the softmax), the embedding
(a lookup), norms, RoPE and attention. Only forwards with gradients enabled use FP8: evaluation, scoring and
generation run the matmuls in the model's dtype, as the exported model will.

The casts, scales and operand layouts are torchao's (`hp_tensor_to_float8_dynamic`, whose tensors run
`torch._scaled_mm`), so `linear` computes what torchao's `Float8Linear` computes, bit for bit
(tests/model/test_float8.py). The autograd function is ours so that it saves the weight itself for backward,
not a transposed view: ZeRO-3 releases a block's gathered weights after its forward by swapping the
parameter's data and regathers them before its backward, and a saved view would keep every block's
gathered copy alive from forward to backward.

torch 2.13 has a CPU kernel for `torch._scaled_mm`, so FP8 runs on CPU too (slowly; the tests use it). On
CUDA the FP8 kernels need compute capability 8.9 (Ada, Hopper and later). torchao is an optional
dependency (`pip install 'olmo-ds[float8]'`), imported only when a recipe other than `off` is used.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
import torch.nn.functional as F

from olmo_ds.model.config import FLOAT8_RECIPES as RECIPES

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell
MIN_TORCHAO = (0, 18)  # the version whose float8 casts this module was written against
MATMULS_PER_BLOCK = 7  # q, k, v, o; gate, up, down
INSTALL = "pip install 'torchao>=0.18' (or pip install -e '.[float8]')"


class _QuietImport(logging.Filter):
    """Two warnings torchao's import prints that concern nothing FP8 training uses: one per prebuilt CUDA
    extension that does not load (every one on a CPU build of torch; float8 training runs `torch._scaled_mm`),
    and torch 2.13's deprecation of how torchao registers an enum with torch.compile."""

    NOISE = {"torchao": "Failed to load", "torch.utils._pytree": "<enum"}

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = self.NOISE.get(record.name)
        return prefix is None or not record.getMessage().startswith(prefix)


@functools.cache
def _torchao():
    """torchao's float8 pieces this module uses, imported once; ImportError with what to install otherwise."""
    quiet = _QuietImport()
    loggers = [logging.getLogger(name) for name in _QuietImport.NOISE]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, ScaledMMConfig
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
    version = tuple(int(p) for p in torchao.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < MIN_TORCHAO:
        raise ImportError(f"it is older than {'.'.join(map(str, MIN_TORCHAO))}")
    return dict(Float8LinearConfig=Float8LinearConfig, get_maybe_axiswise_dim=get_maybe_axiswise_dim,
                hp_tensor_to_float8_dynamic=hp_tensor_to_float8_dynamic, GemmInputRole=GemmInputRole,
                LinearMMConfig=LinearMMConfig, ScaledMMConfig=ScaledMMConfig)


def unavailable() -> str | None:
    """Why FP8 cannot run in this environment (torchao missing or too old), or None when it can."""
    try:
        _torchao()
    except ImportError as e:
        if getattr(e, "name", None) == "torchao":
            return f"torchao is not installed: {INSTALL}"
        return f"torchao {getattr(sys.modules.get('torchao'), '__version__', '')} cannot be used: {e} ({INSTALL})"
    return None


@functools.cache
def _cpu_scaled_mm_problem() -> str | None:
    """Whether this torch has a CPU kernel for `torch._scaled_mm` (torch 2.13 has; older builds may not)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm ({str(e).splitlines()[0][:120]})"
    return None


def device_problem(device_type: str, capability: tuple[int, int] | None = None, name: str | None = None) -> str | None:
    """Why FP8 matmuls cannot run on this device, or None. `capability`/`name`: the CUDA device's (asked
    for before any kernel runs)."""
    if device_type == "cuda":
        if capability is not None and tuple(capability) < MIN_CAPABILITY:
            sm = f"sm_{capability[0]}{capability[1]}"
            return (f"{name or 'this GPU'} is {sm}; FP8 matmuls need compute capability "
                    f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or higher (Ada, Hopper, Blackwell)")
        return None
    if device_type == "cpu":
        return _cpu_scaled_mm_problem()
    return f"FP8 matmuls run on NVIDIA GPUs of sm_89 and later (and on CPU, for tests), not on {device_type}"


@functools.cache
def _recipe(recipe: str):
    """(torchao's Float8LinearConfig, its LinearMMConfig) for a recipe name; built once per process."""
    ao = _torchao()
    config = ao["Float8LinearConfig"].from_recipe_name(recipe)
    gemm = [config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight]
    mm = ao["LinearMMConfig"](*(ao["ScaledMMConfig"](config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemm))
    return config, mm


@functools.cache
def prepare(recipe: str) -> None:
    """Make `recipe` ready before a compiled block traces it; called outside compiled code, once per recipe.

    Imports torchao, builds the recipe's configs, lets torch.compile put `_Float8Matmul` into its graphs as
    one call (as torchao does for its own function: its forward builds float8 tensor subclasses), and applies
    torchao's own guard against a Triton miscompile of compiled FP8 casts (triton-lang/triton#11111), which
    torchao applies in `convert_to_float8_training` and which a functional path would otherwise skip.
    """
    if recipe not in RECIPES or recipe == "off":
        raise ValueError(f"model.float8 {recipe!r}: expected one of {', '.join(RECIPES[1:])} here")
    problem = unavailable()
    if problem:
        raise RuntimeError(f"model.float8 {recipe!r}: {problem}")
    _recipe(recipe)
    torch._dynamo.allow_in_graph(_Float8Matmul)
    try:
        from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen
    except ImportError:  # a torchao without the guard (older or newer layout): nothing to apply
        return
    _patch_inductor_min_max_codegen()


def _cast(t: torch.Tensor, cast, role: str, axis: int, recipe: str):
    """`t` as torchao's float8 tensor for one matmul operand: `cast` (a torchao CastConfig) says dtype and
    granularity; `axis` is the dimension a rowwise scale runs along; `role` says which matmul config applies."""
    ao = _torchao()
    config, mm = _recipe(recipe)
    return ao["hp_tensor_to_float8_dynamic"](
        t, cast.target_dtype, mm, gemm_input_role=ao["GemmInputRole"][role], scaling_granularity=cast.scaling_granularity,
        axiswise_dim=ao["get_maybe_axiswise_dim"](axis, cast.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )


class _Float8Matmul(torch.autograd.Function):
    """x @ weight.T with both operands cast to FP8 (forward), and the input and weight gradients as FP8
    matmuls too (backward), each operand scaled as the recipe says."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # the weight itself: see the module docstring
        ctx.recipe = recipe
        config, _ = _recipe(recipe)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(_cast(flat, config.cast_config_input, "INPUT", -1, recipe),
                       _cast(weight.t(), config.cast_config_weight, "WEIGHT", 0, recipe))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        config, _ = _recipe(recipe)
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        flat = x.reshape(-1, x.shape[-1])
        grad_x = torch.mm(_cast(grad, config.cast_config_grad_output, "GRAD_OUTPUT", -1, recipe),
                          _cast(weight.t(), config.cast_config_weight_for_grad_input, "WEIGHT", -1, recipe).t())
        grad_w = torch.mm(_cast(grad, config.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0, recipe).t(),
                          _cast(flat, config.cast_config_input_for_grad_weight, "INPUT", 0, recipe))
        return grad_x.reshape(x.shape), grad_w, None


def linear(x: torch.Tensor, weight: torch.Tensor, recipe: str = "off") -> torch.Tensor:
    """`F.linear(x, weight)` (no bias), its matmuls in FP8 under `recipe` (`prepare(recipe)` first)."""
    if recipe == "off":
        return F.linear(x, weight)
    return _Float8Matmul.apply(x, weight, recipe)
