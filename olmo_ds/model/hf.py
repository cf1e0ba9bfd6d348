"""The mapping between our model and transformers' Olmo2ForCausalLM / Olmo3ForCausalLM: parameter
names, state dicts and config.json. Files (safetensors, export, import) are `olmo_ds.weights`'s.

Parameter names map one to one (no tensor is split, fused or transposed), so conversion is exact in
both directions. The exported `vocab_size` is our padded vocabulary (as in allenai's released
OLMo 2/3 configs, e.g. 100352); on import the unpadded size is taken from the tokenizer when the
directory has one.
"""

from __future__ import annotations

import math

import torch

from olmo_ds.model.config import ModelConfig, YarnConfig

# (our name pattern, HF name pattern); {i} is the layer index.
_LAYER_NAMES = [
    ("blocks.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blocks.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("blocks.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("blocks.{i}.attn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("blocks.{i}.mlp_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
]
_GLOBAL_NAMES = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
]


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> transformers' name, for every parameter of `cfg`'s model."""
    names = dict(_GLOBAL_NAMES)
    for i in range(cfg.n_layers):
        names.update({ours.format(i=i): theirs.format(i=i) for ours, theirs in _LAYER_NAMES})
    return names


def check_keys(have, want, what: str) -> None:
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def to_hf_state_dict(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' names. With tied embeddings `lm_head.weight` is left out."""
    names = name_map(cfg)
    want = set(names) - ({"head.weight"} if cfg.tie_embeddings else set())
    have = set(state_dict) - ({"head.weight"} if cfg.tie_embeddings else set())
    check_keys(have, want, "model state dict")
    return {names[k]: state_dict[k] for k in want}


def from_hf_state_dict(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> ours (`head.weight` is the embedding when tied)."""
    inverse = {theirs: ours for ours, theirs in name_map(cfg).items()}
    have = set(hf_state) - {k for k in hf_state if k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        have.discard("lm_head.weight")
        inverse.pop("lm_head.weight")
    check_keys(have, inverse, "transformers state dict")
    out = {inverse[k]: hf_state[k] for k in inverse}
    if cfg.tie_embeddings:
        out["head.weight"] = out["embed.weight"]
    return out


DEFAULT_THETA = 500_000.0  # transformers' Olmo2Config / Olmo3Config default RoPE base
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names, as in `layer_types` and `rope_parameters`


def to_hf_config(cfg: ModelConfig, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json for Olmo2ForCausalLM (no sliding window, no YaRN) or Olmo3ForCausalLM.

    RoPE goes in `rope_parameters` as transformers 5.x writes it: one entry per layer type for OLMo 3, one
    for OLMo 2. The legacy `rope_theta` / `rope_scaling` (what transformers 4.x reads) are added where they
    mean the same to every version: for OLMo 3 only when both layer types share one base and the sliding
    layers are unscaled, since 4.x applies `rope_theta` to both types and 5.x to the full layers alone
    (sliding 500,000). Otherwise they are left out, as transformers 5 leaves them out of its own saves.
    """
    olmo3 = bool(cfg.sliding_window) or cfg.yarn is not None
    hf = {
        "architectures": ["Olmo3ForCausalLM" if olmo3 else "Olmo2ForCausalLM"],
        "model_type": "olmo3" if olmo3 else "olmo2",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.padded_vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        **_rope_to_hf(cfg, olmo3),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "torch_dtype": dtype,
    }
    if olmo3:
        hf["sliding_window"] = cfg.sliding_window or cfg.max_seq_len
        hf["layer_types"] = [
            "sliding_attention" if cfg.layer_is_sliding(i) else "full_attention" for i in range(cfg.n_layers)
        ]
    return hf


def _yarn_to_hf(yarn: YarnConfig) -> dict:
    return {"rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "attention_factor": yarn.attention_factor}


def _rope_to_hf(cfg: ModelConfig, olmo3: bool) -> dict:
    """`rope_parameters`, and the legacy `rope_theta` / `rope_scaling` where every transformers reads them alike."""
    def entry(sliding: bool) -> dict:
        theta, yarn = cfg.rope_for(sliding)
        return {**(_yarn_to_hf(yarn) if yarn else {"rope_type": "default"}), "rope_theta": float(theta)}

    if not olmo3:
        return {"rope_parameters": entry(False), "rope_theta": float(cfg.rope_theta), "rope_scaling": None}
    out: dict = {"rope_parameters": {kind: entry(kind == "sliding_attention") for kind in LAYER_TYPES}}
    (full_theta, full_yarn), (sliding_theta, sliding_yarn) = cfg.rope_for(False), cfg.rope_for(True)
    if full_theta == sliding_theta and sliding_yarn is None:
        out["rope_theta"] = float(full_theta)
        out["rope_scaling"] = _yarn_to_hf(full_yarn) if full_yarn else None
    return out


def _rope_entry(params: dict, where: str, key: str, max_positions: int) -> tuple[float, YarnConfig | None]:
    """(base, YaRN or None) of one `rope_parameters` entry (or legacy `rope_scaling`) that carries its
    `rope_theta`; anything olmo-ds cannot compute is refused naming `where` and `key`."""
    if not isinstance(params, dict):
        raise ValueError(f"{where}: {key} must be a mapping, got {params!r}")
    theta = params.get("rope_theta")
    if theta is None or isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{where}: {key}.rope_theta must be a number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: {key}.partial_rotary_factor {partial!r} is not supported (OLMo rotates the whole head)")
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(f"{where}: {key}.rope_type {rope_type!r} is not supported (olmo-ds computes default and yarn)")
    unsupported = {k: params[k] for k in ("mscale", "mscale_all_dim") if params.get(k)}
    if params.get("truncate") is False:
        unsupported["truncate"] = False
    if unsupported:
        raise ValueError(f"{where}: {key}: YaRN options {unsupported} are not supported (OLMo 3 uses none of them)")
    original = params.get("original_max_position_embeddings") or max_positions  # transformers' default
    factor = params.get("factor") or max_positions / original
    yarn = YarnConfig(factor=float(factor), beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1), original_max_position_embeddings=int(original))
    problems = yarn.problems(key)
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    given = params.get("attention_factor")
    if given is not None and not math.isclose(given, yarn.attention_factor, rel_tol=1e-6):
        raise ValueError(f"{where}: {key}.attention_factor {given} differs from 0.1*ln(factor)+1 = "
                         f"{yarn.attention_factor}; only the standard mscale is supported")
    return float(theta), yarn


def _rope_from_hf(hf: dict, where: str, olmo3: bool, has_sliding: bool) -> dict[str, tuple[float, YarnConfig | None]]:
    """(base, YaRN or None) per layer type ("full_attention", "sliding_attention") as the transformers that
    wrote `hf` meant them: `rope_parameters` (5.x; per layer type for OLMo 3) and the legacy `rope_theta` /
    `rope_scaling`, merged the way transformers 5 merges them (legacy scaling goes to the full layers). A
    legacy `rope_theta` other than 500,000 alone, with sliding layers, is refused: 4.x applies it to every
    layer, 5.x to the full ones only (sliding 500,000), and nothing in the file says which was meant."""
    params, legacy_theta, legacy_scaling = hf.get("rope_parameters"), hf.get("rope_theta"), hf.get("rope_scaling")
    max_positions = hf["max_position_embeddings"]
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy_scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: {key} must be a mapping, got {value!r}")
    nested = bool(params) and any(k in LAYER_TYPES for k in params)
    if nested and set(params) - set(LAYER_TYPES):
        raise ValueError(f"{where}: rope_parameters has keys {sorted(set(params) - set(LAYER_TYPES))} beside the layer "
                         f"types {list(LAYER_TYPES)}; olmo-ds cannot tell what they apply to")
    if not olmo3:  # OLMo 2: one entry for every layer
        if nested:
            raise ValueError(f"{where}: rope_parameters per layer type in an olmo2 config (OLMo 2 has one RoPE for all layers)")
        entry = {"rope_type": "default", **(params or {}), **(legacy_scaling or {})}
        entry.setdefault("rope_theta", legacy_theta or DEFAULT_THETA)
        theta_yarn = _rope_entry(entry, where, "rope_parameters" if params else "rope_scaling", max_positions)
        return {kind: theta_yarn for kind in LAYER_TYPES}
    if params and not nested:
        raise ValueError(f"{where}: rope_parameters of an olmo3 config must be given per layer type "
                         f"({', '.join(LAYER_TYPES)}), got one entry {params}")
    if not nested and has_sliding and legacy_theta not in (None, DEFAULT_THETA):
        raise ValueError(
            f"{where}: rope_theta {legacy_theta} without rope_parameters is ambiguous for the sliding-window layers "
            f"(transformers 4.x applies it to them too, 5.x gives them 500000); add \"rope_parameters\": "
            f"{{\"full_attention\": {{\"rope_type\": \"default\", \"rope_theta\": {legacy_theta}}}, \"sliding_attention\": "
            f"{{\"rope_type\": \"default\", \"rope_theta\": ...}}}} naming the base each layer type was trained with")
    out = {}
    for kind in LAYER_TYPES:
        entry = dict((params or {}).get(kind) or {"rope_type": "default"})
        key = f"rope_parameters.{kind}"
        if kind == "full_attention":
            if legacy_scaling:
                entry.update(legacy_scaling)
                key = "rope_scaling" if not nested else f"{key} (with rope_scaling)"
            entry.setdefault("rope_theta", legacy_theta or DEFAULT_THETA)
        else:  # transformers 5 gives a sliding entry without its own base 500,000; without entries, legacy == 500,000 here
            entry.setdefault("rope_theta", DEFAULT_THETA if nested else legacy_theta or DEFAULT_THETA)
        out[kind] = _rope_entry(entry, where, key, max_positions)
    return out


def from_hf_config(hf: dict, vocab_size: int | None = None, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a transformers OLMo-2/3 config.json; `vocab_size` = the tokenizer's, if known."""
    model_type = hf.get("model_type")
    if model_type not in ("olmo2", "olmo3"):
        raise ValueError(f"{where}: model_type {model_type!r} is not an OLMo 2 or OLMo 3 model")
    for key in ("attention_bias", "clip_qkv"):
        if hf.get(key):
            raise ValueError(f"{where}: {key}={hf[key]!r} is not part of the OLMo 2/3 architecture")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r}; OLMo uses silu (SwiGLU)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(f"{where}: head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
    window, pattern = None, []
    if model_type == "olmo3":
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(hf["num_hidden_layers"])
        ]
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{where}: layer_types {unknown} are not OLMo 3 layer types ({', '.join(LAYER_TYPES)})")
        sliding = [t == "sliding_attention" for t in types]
        if any(sliding):
            window, pattern = hf.get("sliding_window", 4096), _shortest_period(sliding[:-1] or sliding)
            expected = [pattern[i % len(pattern)] for i in range(len(types) - 1)] + [False]
            if sliding != expected:
                raise ValueError(f"{where}: layer_types {types} is not a repeating pattern with a full last layer")
    rope = _rope_from_hf(hf, where, olmo3=model_type == "olmo3", has_sliding=bool(window))
    (theta, yarn), (sliding_theta, sliding_yarn) = rope["full_attention"], rope["sliding_attention"]
    if not window:  # no sliding layer: its entry describes nothing
        sliding_theta, sliding_yarn = theta, None
    hf_vocab = hf["vocab_size"]
    if vocab_size is not None and not (hf_vocab - 128 < vocab_size <= hf_vocab):
        vocab_size = None  # the tokenizer does not describe this embedding; keep the embedding's size
    try:
        return ModelConfig(
            d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads, mlp_hidden=hf["intermediate_size"],
            vocab_size=vocab_size or hf_vocab, max_seq_len=hf["max_position_embeddings"], rope_theta=theta,
            norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02), sliding_window=window, sliding_window_pattern=pattern,
            yarn=yarn, sliding_rope_theta=None if sliding_theta == theta else sliding_theta, sliding_yarn=sliding_yarn,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e} (read from its transformers keys)") from None


def _shortest_period(flags: list[bool]) -> list[bool]:
    for period in range(1, len(flags) + 1):
        if all(flags[i] == flags[i % period] for i in range(len(flags))):
            return flags[:period]
    return flags
