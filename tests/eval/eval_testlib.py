"""Shared pieces of the evaluation tests: the real tokenizers, tasks and text in ../shared, tiny models."""

import json
import shutil
from pathlib import Path

import torch

from olmo_ds.model import OLMo, hf, preset
from olmo_ds.tokenizer import load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
PIQA = SHARED / "eval" / "piqa_rc_0shot"
ARC_EASY = SHARED / "eval" / "arc_easy_rc_0shot"
C4 = sorted((SHARED / "data" / "c4-sample").glob("*.json.gz"))


def tiny_olmo(vocab_size: int, max_seq_len: int = 128, seed: int = 0) -> OLMo:
    """A small random OLMo-2: weights scaled up so log-probs differ clearly between choices."""
    torch.manual_seed(seed)
    cfg = preset("tiny", vocab_size=vocab_size, d_model=32, n_heads=4, n_kv_heads=2, mlp_hidden=64, n_layers=2, max_seq_len=max_seq_len, init_std=0.2)
    return OLMo(cfg).eval()


def export_hf(model: OLMo, tokenizer_path: Path, out: Path, extra: dict | None = None) -> Path:
    """A transformers Olmo2 directory of `model`, as an exporter writes it (config, safetensors, tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_path)
    hf.save_safetensors(out, hf.to_hf_state_dict(model.cfg, model.state_dict()))
    (out / "config.json").write_text(json.dumps(hf.to_hf_config(model.cfg, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)))
    shutil.copy(tokenizer_path, out / "tokenizer.json")
    for name, obj in (extra or {}).items():
        (out / name).write_text(json.dumps(obj))
    return out
