"""Fine-tuning's exactness, CPU fp32 (issue 37, Done when (a) and (c)): packed rows of real conversations
(shared/data/chat-sample, OLMo 3 template, dolma2 tokenizer) through the real loader and our model, against
transformers' Olmo3ForCausalLM on the same weights one conversation at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from olmo_ds.data.loader import validation_batches
from olmo_ds.model import ModelConfig
from olmo_ds.model.loss import IGNORE_INDEX

from model_testlib import OLMO3_TINY, hf_model_from, random_model
from sft_testlib import encoded, write_masked_source

SEQ = 512


def conversations():
    return list(encoded("train"))


def _tiny_real_vocab(seed=0):
    cfg = ModelConfig(**{**OLMO3_TINY, "vocab_size": 100278, "max_seq_len": SEQ, "d_model": 32, "n_layers": 3,
                         "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 48,
                         "init_std": 0.2})  # large weights: a context-sensitive loss, far from ln(vocab)
    return random_model(cfg, seed)


def test_packed_loss_equals_transformers_one_conversation_at_a_time(tmp_path):
    """Done when (a): the token-weighted loss through olmo-ds's packed rows == transformers' Olmo3ForCausalLM
    run on each conversation alone with masked labels, within 1e-5 (CPU fp32)."""
    chosen = [c for c in conversations() if len(c[0]) <= SEQ][:24]
    src = write_masked_source(tmp_path / "chat", chosen, shard_docs=10)
    model = _tiny_real_vocab()
    hf = hf_model_from(model)
    total, count = 0.0, 0
    # (RoPE is relative: positions not restarted per conversation change only rounding, so only the masking is checked here.)
    wrong = {"no document masking": 0.0}
    with torch.no_grad():
        for b in validation_batches(str(src), SEQ, 4, 0, 1):
            out = model(b["input_ids"], labels=b["labels"], doc_lens=b["doc_lens"], positions=b["positions"], loss_divisor=1.0)
            total += float(out.ce_loss)
            count += int((b["labels"] != IGNORE_INDEX).sum())
            wrong["no document masking"] += float(model(b["input_ids"], labels=b["labels"], loss_divisor=1.0).ce_loss)
        ours = total / count
        ref_sum, ref_n = 0.0, 0
        for ids, mask in chosen:
            ids_t = torch.as_tensor(ids.astype(np.int64))[None]
            labels = torch.where(torch.as_tensor(mask[1:]), ids_t[0, 1:], IGNORE_INDEX)
            logits = hf(ids_t).logits[0, :-1].double()
            ref_sum += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
            ref_n += int((labels != IGNORE_INDEX).sum())
    assert count == ref_n == sum(int(m[1:].sum()) for _, m in chosen)
    assert abs(ours - ref_sum / ref_n) <= 1e-5 * max(1.0, abs(ours)), (ours, ref_sum / ref_n)
    for what, value in wrong.items():  # the test can tell: either mistake moves the loss far beyond the tolerance
        assert abs(value / count - ref_sum / ref_n) > 1e-4 * ours, what


def test_no_attention_across_conversations(tmp_path):
    """Done when (c): perturbing one conversation's tokens in a packed row changes no other conversation's
    per-token losses (and does change its own)."""
    src = write_masked_source(tmp_path / "chat", [c for c in conversations() if len(c[0]) <= 160][:40], shard_docs=40)
    b = next(iter(validation_batches(str(src), SEQ, 1, 0, 1)))
    pieces = b["doc_lens"][0][b["doc_lens"][0] > 0].tolist()
    assert len(pieces) >= 3
    model = _tiny_real_vocab(1)

    def per_token(ids):
        with torch.no_grad():
            logits = model(ids, doc_lens=b["doc_lens"], positions=b["positions"])[0].double()
        return torch.nn.functional.cross_entropy(logits, b["labels"][0].clamp(min=0), reduction="none")

    base = per_token(b["input_ids"])
    ends = np.cumsum(pieces)
    lo, hi = int(ends[0]), int(ends[1])  # the second conversation
    ids = b["input_ids"].clone()
    ids[0, lo + 3:hi - 1] = (ids[0, lo + 3:hi - 1] * 7 + 11) % 100000
    changed = per_token(ids)
    others = torch.ones(SEQ, dtype=torch.bool)
    others[lo:hi] = False
    assert torch.allclose(changed[others], base[others], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[lo + 4:hi - 1], base[lo + 4:hi - 1], atol=1e-3)


def test_masked_validation_loss_is_the_per_conversation_loss(tmp_path):
    """Evaluation of a masked validation source (what in-loop eval reports as eval/<source>/loss) scores packed
    rows with their conversations' attention and positions: equal to the same model one conversation at a time,
    in both batching modes."""
    from olmo_ds.eval.perplexity import evaluate_perplexity

    chosen = [c for c in conversations() if len(c[0]) <= SEQ][24:40]
    src = write_masked_source(tmp_path / "val", chosen, shard_docs=8, split="val")
    model = _tiny_real_vocab(2)
    batches = list(validation_batches(str(src), SEQ, 3, 0, 1))
    table = np.ones(model.cfg.padded_vocab_size, dtype=np.int64)
    with torch.no_grad():
        ref_sum, ref_n = 0.0, 0
        for ids, mask in chosen:
            ids_t = torch.as_tensor(ids.astype(np.int64))[None]
            labels = torch.where(torch.as_tensor(mask[1:]), ids_t[0, 1:], IGNORE_INDEX)
            logits = model(ids_t)[0, :-1].double()
            ref_sum += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
            ref_n += int((labels != IGNORE_INDEX).sum())
    for batching in ("packed", "exact"):
        r = evaluate_perplexity(model, batches, table, batching=batching)
        assert r.tokens == ref_n
        assert abs(r.ce_loss - ref_sum / ref_n) <= 1e-5 * ref_sum / ref_n, (batching, r.ce_loss, ref_sum / ref_n)

    # scripts/eval.py on the same source, the model as a model directory: the masked loss, not every token's.
    import json
    import runpy
    import shutil

    from olmo_ds import weights
    from sft_testlib import DOLMA2

    ours = tmp_path / "model"
    weights.save_model_dir(ours, model.cfg, model.state_dict())
    shutil.copy(DOLMA2, ours / "tokenizer.json")
    main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "eval.py"))["main"]
    assert main([str(ours), "--data", f"chat={src}", "--seq-len", str(SEQ), "--batch-tokens", str(3 * SEQ), "--out", str(tmp_path / "eval")]) == 0
    r = json.loads((tmp_path / "eval" / "results.json").read_text())["perplexity"]["chat"]
    assert r["kind"] == "conversations" and r["tokens"] == ref_n, r
    assert abs(r["ce_loss"] - ref_sum / ref_n) <= 1e-5 * ref_sum / ref_n, (r["ce_loss"], ref_sum / ref_n)
