"""Model configuration and the named presets.

Presets are code, not YAML, so a typo is an import error and a test can check every preset's
parameter count against the published size.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

VOCAB_MULTIPLE = 128  # embedding rows are padded to a multiple of this (tensor-core friendly)
ATTENTION_BACKENDS = (
    "auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flex", "flash_attn3",
)
# Names refused with their reason: a backend that has never run on a GPU here is not offered (BENCHMARKS.md,
# "flash-attn on the GPU").
REFUSED_ATTENTION_BACKENDS = {
    "flash_attn": "the flash-attn 2.x package is unverified: it has never run in this project (PyPI has it as source "
                  "only, and its 72 kernels per GPU architecture were not built on the GPU host). Use 'flash_attn3' on Hopper "
                  "(`make flash-attn`), 'sdpa_flash' (PyTorch's copy of the FlashAttention-2 kernels, causal only), "
                  "'flex' or 'auto'",
}
COMPILE_MODES = ("auto", "blocks", "eager")
FLOAT8_RECIPES = ("off", "tensorwise", "rowwise")  # olmo_ds/model/float8.py
# Which model fields may differ between a run and the state it continues or starts from (`model_differences`):
# Fields that choose how the model computes (kernels, recomputation, compilation, FP8 matmuls with dynamic
# scaling, which keep no state), not its weights: a checkpoint resumes under other values of these.
EXECUTION_FIELDS = frozenset({"attention_backend", "activation_checkpointing", "compile", "float8"})
# Fields a run may change against the weights it starts from, when `init_from.allow_changes` names them: the
# context length and RoPE scaling (long-context extension: OLMo 3's YaRN on the full layers).
INIT_CHANGEABLE = ("max_seq_len", "yarn", "rope_theta", "sliding_rope_theta", "sliding_yarn")
# Fields that name rather than shape the weights: the tokenizer's id count (the embedding's padded rows are
# the shape), the initialisation's spread (loaded weights are not drawn) and the sliding-window pattern as
# written (the layers it makes sliding are what counts). Free when only the weights are taken (init_from).
WEIGHTS_ONLY_FREE = frozenset({"init_std", "vocab_size", "sliding_window_pattern"})


@dataclass
class YarnConfig:
    """YaRN RoPE scaling: OLMo 3 applies it to the full-attention layers (`ModelConfig.yarn`); `sliding_yarn`
    scales the sliding-window layers too, for models that do (transformers' `rope_parameters` per layer type)."""

    factor: float = 8.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 8192

    @property
    def attention_factor(self) -> float:
        """The "mscale" 0.1 * ln(factor) + 1 that multiplies cos and sin (as in YaRN and transformers)."""
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def problems(self, key: str) -> list[str]:
        """What makes these settings give NaN or nonsense tables, each naming `key`'s field and value."""
        found = []
        for name in ("factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                found.append(f"{key}.{name} must be a finite number, got {value!r}")
        if found:
            return found
        if self.factor < 1:
            found.append(f"{key}.factor must be >= 1 (the context is stretched, never shrunk), got {self.factor!r}")
        if not self.beta_fast > self.beta_slow > 0:
            found.append(f"{key} needs beta_fast > beta_slow > 0 (the ends of the interpolation ramp, by default 32 and 1), "
                         f"got beta_fast {self.beta_fast!r}, beta_slow {self.beta_slow!r}")
        if not _is_int(self.original_max_position_embeddings) or self.original_max_position_embeddings <= 0:
            found.append(f"{key}.original_max_position_embeddings must be a positive integer, "
                         f"got {self.original_max_position_embeddings!r}")
        return found


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ModelConfig:
    """An OLMo-2 / OLMo-3 decoder.

    `vocab_size` is the number of ids the tokenizer can produce; the embedding and the output head
    have `padded_vocab_size` rows (rounded up to a multiple of 128).
    """

    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    n_kv_heads: int | None = None  # None = n_heads (no GQA)
    mlp_hidden: int = 8192
    vocab_size: int = 100278
    max_seq_len: int = 4096
    # RoPE base of every layer, or of the full-attention layers when `sliding_rope_theta` is set (transformers'
    # `rope_parameters` per layer type; see docs/training.md, "RoPE per layer type").
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    # OLMo 3 sliding-window attention: window size in tokens and the per-layer pattern.
    # `sliding_window_pattern` is a list of booleans repeated over the layers (True = sliding);
    # the last layer is always full attention.
    sliding_window: int | None = None
    sliding_window_pattern: list[bool] = field(default_factory=list)
    yarn: YarnConfig | None = None  # YaRN on the full-attention layers (OLMo 3's long-context stage)
    sliding_rope_theta: float | None = None  # the sliding-window layers' RoPE base; None = rope_theta
    sliding_yarn: YarnConfig | None = None  # YaRN on the sliding-window layers; None = none (OLMo 3)
    # See olmo_ds/model/attention.py: auto | sdpa | sdpa_cudnn | sdpa_flash | sdpa_efficient |
    # sdpa_math | flex | flash_attn3.
    attention_backend: str = "auto"
    # Recompute blocks in the backward pass to save activation memory: false | true (= full: every block) |
    # every_k:N (blocks 0, N, 2N, ...: 1/N of the recomputation, about 1 - 1/N of the blocks' activations kept).
    activation_checkpointing: bool | str = False
    # torch.compile each block as one function of its weights (olmo_ds/model/model.py `block_math`):
    # auto = compiled on CUDA, eager on CPU | blocks = always compiled | eager = never. Changes speed, not the math.
    compile: str = "auto"
    # FP8 matmuls in the blocks while training (olmo_ds/model/float8.py; needs torchao: pip install -e '.[float8]'):
    # off | tensorwise | rowwise (torchao's recipes, dynamic scaling). LM head, embedding and evaluation stay in the
    # training dtype. CUDA needs sm_89+ (Ada, Hopper); CPU runs it slowly (tests).
    float8: bool | str = "off"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for key in ("yarn", "sliding_yarn"):
            if isinstance(getattr(self, key), dict):
                try:
                    setattr(self, key, YarnConfig(**getattr(self, key)))
                except TypeError as e:
                    raise ValueError(f"model.{key}: {e}") from None
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by model.n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads {self.n_heads} is not divisible by model.n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model head_dim {self.head_dim} (d_model / n_heads) must be even for RoPE")
        self._check_numbers()
        self._check_sliding()
        if self.attention_backend in REFUSED_ATTENTION_BACKENDS:
            raise ValueError(f"model.attention_backend {self.attention_backend!r} is refused: "
                             f"{REFUSED_ATTENTION_BACKENDS[self.attention_backend]}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention_backend {self.attention_backend!r} is not one of: "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        self.checkpoint_interval()  # raises on an unknown form
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"model.compile {self.compile!r} is not one of: {', '.join(COMPILE_MODES)} "
                             f"(auto = compiled blocks on CUDA, eager on CPU)")
        self._check_float8()

    def _check_numbers(self) -> None:
        """The values that give NaN or a model that cannot learn from step 1 (a RoPE base <= 1, a norm epsilon <= 0,
        zero initial weights, YaRN with an empty ramp) are refused here, before any engine starts."""
        for key in ("rope_theta", "sliding_rope_theta"):
            value = getattr(self, key)
            if value is None and key == "sliding_rope_theta":
                continue
            if not _is_number(value) or not math.isfinite(value) or value <= 1:
                raise ValueError(f"model.{key} must be a finite number > 1 (the RoPE base: wavelengths grow as powers of it; "
                                 f"OLMo uses 500000), got {value!r}")
        for key, meaning in (("norm_eps", "the RMSNorm epsilon, e.g. 1e-6; 0 divides by zero on a zero vector"),
                             ("init_std", "the initial weights' standard deviation, e.g. 0.02")):
            value = getattr(self, key)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"model.{key} must be a finite number > 0 ({meaning}), got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        for key in ("yarn", "sliding_yarn"):
            yarn = getattr(self, key)
            if yarn is not None and not isinstance(yarn, YarnConfig):
                raise ValueError(f"model.{key} must be a mapping of YaRN settings or null, got {yarn!r}")
            problems = yarn.problems(f"model.{key}") if yarn is not None else []
            if problems:
                raise ValueError("; ".join(problems))

    def _check_sliding(self) -> None:
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window <= 0):
            raise ValueError(f"model.sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if not isinstance(self.sliding_window_pattern, list) or not all(isinstance(x, bool) for x in self.sliding_window_pattern):
            raise ValueError(f"model.sliding_window_pattern must be a list of true/false (true = sliding), "
                             f"got {self.sliding_window_pattern!r}")
        if self.sliding_window_pattern and not self.sliding_window:
            raise ValueError("model.sliding_window_pattern is set but model.sliding_window is not")
        if self.sliding_window and not self.sliding_window_pattern:
            raise ValueError("model.sliding_window is set but model.sliding_window_pattern is empty "
                             "(e.g. [true, true, true, false] for OLMo 3)")
        if not any(self.layer_is_sliding(i) for i in range(self.n_layers)):
            for key in ("sliding_rope_theta", "sliding_yarn"):
                if getattr(self, key) is not None:
                    raise ValueError(f"model.{key} is set but no layer is sliding (model.sliding_window, "
                                     f"model.sliding_window_pattern); it would change nothing")

    def _check_float8(self) -> None:
        """`float8` is a known recipe (YAML's unquoted `off` arrives as false) and the blocks' matmuls have the
        shapes FP8 kernels take: every dimension a multiple of 16."""
        if self.float8 is False:
            self.float8 = "off"
        if self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"model.float8 {self.float8!r} is not one of: {', '.join(FLOAT8_RECIPES)} "
                             f"(torchao's float8 training recipes; off = the training dtype)")
        if self.float8 == "off":
            return
        dims = {"d_model": self.d_model, "n_heads x head_dim": self.n_heads * self.head_dim,
                "n_kv_heads x head_dim": self.n_kv_heads * self.head_dim, "mlp_hidden": self.mlp_hidden}
        odd = [f"{name} {value}" for name, value in dims.items() if value % 16]
        if odd:
            raise ValueError(f"model.float8 {self.float8!r} needs the blocks' matmul dimensions to be multiples of 16 "
                             f"(FP8 kernels' requirement); not: {', '.join(odd)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def rope_for(self, sliding: bool) -> tuple[float, YarnConfig | None]:
        """(RoPE base, YaRN or None) of the sliding-window layers (`sliding`) or of the full-attention ones."""
        if sliding:
            return (self.rope_theta if self.sliding_rope_theta is None else self.sliding_rope_theta), self.sliding_yarn
        return self.rope_theta, self.yarn

    def layer_is_sliding(self, layer: int) -> bool:
        """Whether `layer` uses sliding-window attention (the last layer never does)."""
        if not self.sliding_window or not self.sliding_window_pattern or layer == self.n_layers - 1:
            return False
        return self.sliding_window_pattern[layer % len(self.sliding_window_pattern)]

    def checkpoint_interval(self) -> int | None:
        """Every how many blocks one is recomputed in backward (1 = all), or None for no checkpointing."""
        value = self.activation_checkpointing
        if isinstance(value, bool):
            return 1 if value else None
        if value == "full":
            return 1
        prefix = "every_k:"
        if isinstance(value, str) and value.startswith(prefix) and value[len(prefix):].isdigit() and int(value[len(prefix):]) >= 1:
            return int(value[len(prefix):])
        raise ValueError(f"model.activation_checkpointing {value!r} is not one of: false, true, full, every_k:N "
                         f"(N >= 1: recompute blocks 0, N, 2N, ...; e.g. every_k:2 for half of them)")

    def checkpoints_block(self, layer: int) -> bool:
        """Whether block `layer` is recomputed in backward under `activation_checkpointing`."""
        interval = self.checkpoint_interval()
        return interval is not None and layer % interval == 0

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of the model this config builds."""
        d, hd = self.d_model, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + q + kv  # projections + QK-norm weights
        mlp = 3 * d * self.mlp_hidden
        block = attn + mlp + 2 * d  # two post-norms
        body = self.n_layers * block + d  # final norm
        if not include_embedding:
            return body
        emb = self.padded_vocab_size * d
        return body + emb + (0 if self.tie_embeddings else emb)

    def compiles_blocks(self, device_type: str) -> bool:
        """Whether `compile` asks for compiled blocks on a device of this type ("cuda", "cpu", ...).

        "auto" compiles on CUDA only: that is where it was measured to pay (BENCHMARKS.md), while on
        CPU inductor's compile time outweighs what the few steps of a test or demo gain.
        """
        return self.compile == "blocks" or (self.compile == "auto" and device_type == "cuda")

    @property
    def flops_params(self) -> int:
        """Parameters whose matmuls run once per token: all but the input embedding (a lookup).

        The output head counts even when tied to the embedding, since its matmul runs either way.
        """
        return self.num_params(include_embedding=False) + self.padded_vocab_size * self.d_model

    def attended_span(self, seq_len: int) -> int:
        """Sum over layers of the keys a query attends to: T, or min(T, window) on a sliding layer."""
        return sum(min(seq_len, self.sliding_window) if self.layer_is_sliding(i) else seq_len
                   for i in range(self.n_layers))

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x `flops_params` + 12 x d_model x `attended_span`.

        The PaLM/OLMo formula 6N + 12 L d T, with N every parameter except the input embedding (the
        output head included, as OLMo-core and PaLM count it), so MFU compares with theirs; a
        sliding-window layer counts min(T, window) keys instead of T.
        """
        return 6 * self.flops_params + 12 * self.d_model * self.attended_span(seq_len)

    def flops_formula(self, seq_len: int) -> str:
        """`flops_per_token` written out with this model's numbers, for logs and reports."""
        span = self.attended_span(seq_len)
        attn = (f"{self.n_layers} layers x {self.d_model} d_model x {seq_len} seq_len"
                if span == self.n_layers * seq_len else f"{self.d_model} d_model x {span:,} keys summed over layers")
        return (f"FLOPs/token = 6 x {self.flops_params:,} params (all but the input embedding; output head included) "
                f"+ 12 x {attn} = {self.flops_per_token(seq_len):.4g}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**d)


def model_differences(source: ModelConfig, target: ModelConfig, *, allow_changes: frozenset[str] | set[str] = frozenset(),
                      weights_only: bool = False) -> list[tuple[str, object, object]]:
    """(what, source's, target's) for every way a run with model `target` cannot take over `source`'s state: the
    one rule for resuming a checkpoint and for starting from weights (`init_from`). A model field is named
    bare ("d_model"); `EXECUTION_FIELDS` and `allow_changes` never count. `weights_only`: the run takes the
    weights alone (a fresh schedule and data), so `WEIGHTS_ONLY_FREE` do not count and the shapes they stand
    for are compared instead: "embedding rows (padded vocab)" and "sliding-window layers" (over the layers
    both have)."""
    skip = EXECUTION_FIELDS | set(allow_changes) | (WEIGHTS_ONLY_FREE if weights_only else frozenset())
    diffs = [(f.name, getattr(source, f.name), getattr(target, f.name)) for f in dataclasses.fields(ModelConfig)
             if f.name not in skip and getattr(source, f.name) != getattr(target, f.name)]
    if not weights_only:
        return diffs
    if source.padded_vocab_size != target.padded_vocab_size:
        diffs.append(("embedding rows (padded vocab)", source.padded_vocab_size, target.padded_vocab_size))
    layers = range(min(source.n_layers, target.n_layers))
    if [source.layer_is_sliding(i) for i in layers] != [target.layer_is_sliding(i) for i in layers]:
        diffs.append(("sliding-window layers", [i for i in layers if source.layer_is_sliding(i)],
                      [i for i in layers if target.layer_is_sliding(i)]))
    return diffs


def _olmo3_pattern() -> list[bool]:
    return [True, True, True, False]


# OLMo 3 trains at 8192 tokens without YaRN; its long-context stage turns YaRN on for the full-attention
# layers: preset("olmo3-7b", max_seq_len=65536, yarn=YarnConfig(factor=8, original_max_position_embeddings=8192)).
PRESETS: dict[str, ModelConfig] = {
    # Tiny: tests and the demo. Vocab is set from the tokenizer by the train config.
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=192, vocab_size=4096, max_seq_len=256),
    "olmo2-1b": ModelConfig(d_model=2048, n_layers=16, n_heads=16, mlp_hidden=8192, vocab_size=100278, max_seq_len=4096),
    "olmo2-7b": ModelConfig(d_model=4096, n_layers=32, n_heads=32, mlp_hidden=11008, vocab_size=100278, max_seq_len=4096),
    "olmo2-13b": ModelConfig(d_model=5120, n_layers=40, n_heads=40, mlp_hidden=13824, vocab_size=100278, max_seq_len=4096),
    # An OLMo-3-style 1B (not a released model): OLMo 2 1B's dimensions with OLMo 3's attention layout and context,
    # the size whose whole stage chain (pretrain, mid-train, long context) fits one GPU.
    "olmo3-style-1b": ModelConfig(
        d_model=2048, n_layers=16, n_heads=16, mlp_hidden=8192, vocab_size=100278, max_seq_len=8192,
        sliding_window=4096, sliding_window_pattern=_olmo3_pattern(),
    ),
    "olmo3-7b": ModelConfig(
        d_model=4096, n_layers=32, n_heads=32, mlp_hidden=11008, vocab_size=100278, max_seq_len=8192,
        sliding_window=4096, sliding_window_pattern=_olmo3_pattern(),
    ),
    "olmo3-32b": ModelConfig(
        d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8, mlp_hidden=27648, vocab_size=100278, max_seq_len=8192,
        sliding_window=4096, sliding_window_pattern=_olmo3_pattern(),
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A fresh copy of a named preset with field overrides (nothing shared with PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return dataclasses.replace(copy.deepcopy(PRESETS[name]), **overrides)
