"""Shared pieces of the evaluation tests: the real tokenizers, tasks and text in ../shared, tiny models."""

import shutil
from pathlib import Path

import numpy as np
import torch

from olmo_ds.data import shards
from olmo_ds import weights
from olmo_ds.model import OLMo, preset
from testdata import SHARED

NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
PIQA = SHARED / "eval" / "piqa_rc_0shot"
ARC_EASY = SHARED / "eval" / "arc_easy_rc_0shot"
C4 = sorted((SHARED / "data" / "c4-sample").glob("*.json.gz"))


def tiny_config(vocab_size: int, max_seq_len: int = 128):
    """A small OLMo-2; init_std 0.2 so a random model's log-probs differ clearly between choices."""
    return preset("tiny", vocab_size=vocab_size, d_model=32, n_heads=4, n_kv_heads=2, mlp_hidden=64, n_layers=2, max_seq_len=max_seq_len, init_std=0.2)


def tiny_olmo(vocab_size: int, max_seq_len: int = 128, seed: int = 0) -> OLMo:
    torch.manual_seed(seed)
    return OLMo(tiny_config(vocab_size, max_seq_len)).eval()


def export_hf(model: OLMo, tokenizer_path: Path, out: Path) -> Path:
    """`model` as scripts/export_hf.py writes it (via our model directory, as scripts/import_hf.py would)."""
    ours = out.with_name(out.name + "-olmo")
    weights.save_model_dir(ours, model.cfg, model.state_dict())
    shutil.copy(tokenizer_path, ours / "tokenizer.json")
    return weights.export_hf(ours, out)


def write_shards(directory, tokens, tokenizer, docs):
    """`tokens` as a two-shard directory (the real writer) labelled with `tokenizer`'s fingerprint."""
    directory.mkdir(parents=True)
    cut = len(tokens) // 2
    metas = [shards.write_shard(directory, i, part, np.array([0, len(part)]), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
             for i, part in enumerate([tokens[:cut], tokens[cut:]])]
    shards.Manifest(num_tokens=len(tokens), num_docs=docs, shards=[m.bin for m in metas], dtype=metas[0].dtype,
                    vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, tokenizer_fingerprint=tokenizer.fingerprint).save(directory)
