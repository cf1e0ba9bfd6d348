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


def to_hf_config(cfg: ModelConfig, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json for Olmo2ForCausalLM (no sliding window, no YaRN) or Olmo3ForCausalLM.

    RoPE is written in the legacy `rope_theta` / `rope_scaling` keys, which transformers 4.x and 5.x
    and vLLM all read.
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
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
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
    if cfg.yarn is not None:
        hf["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": cfg.yarn.factor,
            "beta_fast": cfg.yarn.beta_fast,
            "beta_slow": cfg.yarn.beta_slow,
            "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
            "attention_factor": cfg.yarn.attention_factor,
        }
    return hf


def _rope_from_hf(hf: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, yarn scaling dict or None) from either the legacy or the transformers-5 keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    theta = hf.get("rope_theta") or (params or {}).get("rope_theta") or 500_000.0
    scaling = hf.get("rope_scaling") or params
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (only default and yarn)")
    return float(theta), scaling


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
    theta, scaling = _rope_from_hf(hf, where)
    yarn = None
    if scaling is not None:
        yarn = YarnConfig(
            factor=float(scaling["factor"]), beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
        unsupported = {k: scaling[k] for k in ("mscale", "mscale_all_dim", "partial_rotary_factor") if scaling.get(k)}
        if scaling.get("truncate") is False:
            unsupported["truncate"] = False
        if unsupported:
            raise ValueError(f"{where}: YaRN options {unsupported} are not supported (OLMo 3 uses none of them)")
        given = scaling.get("attention_factor")
        if given is not None and not math.isclose(given, yarn.attention_factor, rel_tol=1e-6):
            raise ValueError(f"{where}: YaRN attention_factor {given} differs from 0.1*ln(factor)+1 = "
                             f"{yarn.attention_factor}; only the standard mscale is supported")
    window, pattern = None, []
    if model_type == "olmo3":
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(hf["num_hidden_layers"])
        ]
        sliding = [t == "sliding_attention" for t in types]
        if any(sliding):
            window, pattern = hf.get("sliding_window", 4096), _shortest_period(sliding[:-1] or sliding)
            expected = [pattern[i % len(pattern)] for i in range(len(types) - 1)] + [False]
            if sliding != expected:
                raise ValueError(f"{where}: layer_types {types} is not a repeating pattern with a full last layer")
    hf_vocab = hf["vocab_size"]
    if vocab_size is not None and not (hf_vocab - 128 < vocab_size <= hf_vocab):
        vocab_size = None  # the tokenizer does not describe this embedding; keep the embedding's size
    return ModelConfig(
        d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, mlp_hidden=hf["intermediate_size"],
        vocab_size=vocab_size or hf_vocab, max_seq_len=hf["max_position_embeddings"], rope_theta=theta,
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02), sliding_window=window, sliding_window_pattern=pattern,
        yarn=yarn,
    )


def _shortest_period(flags: list[bool]) -> list[bool]:
    for period in range(1, len(flags) + 1):
        if all(flags[i] == flags[i % period] for i in range(len(flags))):
            return flags[:period]
    return flags
