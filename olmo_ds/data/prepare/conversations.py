"""Conversations (`prepare_data.py --format chat`): a block of `messages` records → ids and a loss mask.

One document is one conversation rendered with a chat template and tokenised by `olmo_ds.chat.ChatEncoder`
(it ends in the template's single EOS; its mask is 1 on the tokens to train), so the pipeline writes
masked shards (`shards.ShardWriter(masked=True)`) with every guarantee of the text path: the same
worker-count independent order, resume points, pieces and partitions. What is decided here, per record:

- a record the encoder refuses (unknown role, missing content, ending on a user turn, template error,
  no trained token, ...) is skipped under a reason key (`reason_of`) with its `file:line` and the
  encoder's words, or stops the run under `--strict`;
- a conversation longer than `--max-tokens`: `drop` skips it (`too_long`, counted, never a `--strict`
  stop: it is a choice, not bad input); `truncate` keeps its first N tokens and their mask, as
  open-instruct does, with no EOS appended (the document then ends without EOS; noted as
  `truncated_conversation`); one left with no trained token is skipped (`truncated_no_target`);
- content holding special-token text is kept as text (noted as `special_token_text`).
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import orjson

from olmo_ds.chat import ChatEncoder, ChatError, load_chat_template

# Skip reasons of conversations (the manifest's `skipped` counts, beside the readers' own).
TOO_LONG = "too_long"
TRUNCATED_NO_TARGET = "truncated_no_target"
NO_TARGET = "no_trained_tokens"
# Reasons that follow from an option, not from bad input: counted, but `--strict` does not stop on them.
POLICY_REASONS = (TOO_LONG, TRUNCATED_NO_TARGET)
TRUNCATED = "truncated_conversation"  # noted: kept, cut to --max-tokens

LONG_CONVERSATIONS = ("drop", "truncate")

# The encoder's refusal → a stable reason key (its message goes with the file:line example).
_REASONS = [
    (r"^'messages' is empty", "empty_messages"),
    (r"^'messages' is ", "messages_not_a_list"),
    (r"not an object with 'role'", "message_not_an_object"),
    (r"has no 'role'|role is \w+, not a string", "missing_role"),
    (r"unknown role", "unknown_role"),
    (r"has no 'content'|content is null", "missing_content"),
    (r"content is a \w+, not a string", "content_not_a_string"),
    (r"not valid Unicode text", "invalid_utf8"),
    (r"^ends on a ", "not_ending_on_assistant"),
    (r"special-token text", "special_token_text"),
    (r"EOS", "eos_not_at_end"),
    (r"no token is a training target", NO_TARGET),
    (r"chat template", "template_error"),
]


def reason_of(error: ChatError) -> str:
    """A stable key for why the encoder refused a conversation (`ChatError.reason` is prose)."""
    for pattern, key in _REASONS:
        if re.search(pattern, error.reason):
            return key
    return "invalid_conversation"


def template_sha256(template) -> str:
    """The template's fingerprint: sha256 of its Jinja source."""
    return "sha256:" + hashlib.sha256(template.text.encode("utf-8")).hexdigest()


_encoders: dict = {}  # per worker process: the encoder for a spec, built once


def encoder_for(spec, tokenizer) -> ChatEncoder:
    if spec not in _encoders:
        template = load_chat_template(spec.chat_template, tokenizer)
        _encoders[spec] = ChatEncoder(template, tokenizer, mask=spec.chat_mask)
    return _encoders[spec]


def conversation_text(messages) -> str:
    """The text a conversation's validation-split hash is taken of (the same for any worker or resume)."""
    return orjson.dumps(messages, option=orjson.OPT_SORT_KEYS).decode("utf-8", errors="surrogatepass")


def encode_records(spec, tokenizer, records: list, base: int, dtype: np.dtype):
    """`records` (line, messages, reason) of one block → (lines kept, tokens, doc_lens, mask, skips,
    special_at lines, notes, texts for the split hash). Skips are `(base + line, reason, detail)`."""
    enc = encoder_for(spec, tokenizer)
    skips, notes = [], []
    candidates = [(line, messages) for line, messages, _ in records if messages is not None]
    skips += [(base + line, reason, "") for line, messages, reason in records if messages is None]
    encoded = enc.encode_batch([m for _, m in candidates]) if candidates else []
    lines, ids, masks, special, texts = [], [], [], [], []
    limit = spec.max_tokens
    for (line, messages), got in zip(candidates, encoded):
        if isinstance(got, ChatError):
            skips.append((base + line, reason_of(got), got.reason))
            continue
        tokens, mask = got.ids, got.mask
        if limit and len(tokens) > limit:
            if spec.long_conversations == "drop":
                skips.append((base + line, TOO_LONG, f"{len(tokens):,} tokens > --max-tokens {limit:,}"))
                continue
            tokens, mask = tokens[:limit], mask[:limit]
            if not mask.any():
                skips.append((base + line, TRUNCATED_NO_TARGET, f"{len(got.ids):,} tokens, none trained in the first {limit:,}"))
                continue
            notes.append((base + line, TRUNCATED))
        lines.append(line)
        ids.append(tokens)
        masks.append(mask)
        if got.escaped:
            special.append(line)
        if spec.val_fraction > 0:
            texts.append(conversation_text(messages))
    return block_result(lines, ids, masks, skips, special, notes, texts, dtype)


def block_result(lines: list[int], ids: list, masks: list, skips: list, special: list[int], notes: list, texts: list, dtype):
    """A block's documents as the pipeline takes them: (kept lines, their ids and lengths, their loss mask, skips in
    line order, lines with special-token text, notes, texts for the validation split's hash)."""
    skips.sort(key=lambda s: s[0])
    if ids:
        tokens = np.concatenate(ids).astype(dtype, copy=False)
        mask = np.concatenate(masks).astype(bool, copy=False)
        lens = np.array([len(t) for t in ids], dtype=np.int64)
    else:
        tokens, mask, lens = np.zeros(0, dtype), np.zeros(0, bool), np.zeros(0, np.int64)
    return np.array(lines, dtype=np.int64), tokens, lens, mask, skips, np.array(special, dtype=np.int64), notes, texts
