"""Preference pairs (`prepare_data.py --format preference`): `{"chosen": [...], "rejected": [...]}` records →
two masked documents per pair.

A pair is two conversations that share every message but the final assistant reply (the layout of the
public preference mixes that OLMo 2 and OLMo 3 were tuned on with DPO). Each side is rendered with the chat
template and tokenised by `olmo_ds.chat.ChatEncoder` with mask="last": its final reply (through the
template's closer) is trained, earlier assistant turns are context. Pair i becomes documents 2i (chosen)
and 2i + 1 (rejected) of a preference shard (`olmo_ds.data.shards`). Both documents carry the record's
input position, and the validation split is decided by a hash of the whole record, so a shard boundary, a
resume point or the split never separates them; everything else is the conversation path's (`conversations`).

What is decided here, per record; each refusal is skipped under its own reason key with its `file:line`
and what was wrong, or stops the run under `--strict`:
- the reader's: `malformed_json`, `invalid_utf8`, `not_an_object` (a JSON line that is no object),
  `missing_chosen`, `missing_rejected`;
- `side_not_a_list` (a side that is not a list of messages), then what the chat encoder refuses in either
  side, under the conversation path's keys (`unknown_role`, `content_not_a_string`, `not_ending_on_assistant`,
  ...; the detail names the side);
- `empty_reply` (a final reply with no text: the side would train only its closing EOS);
- `prompts_differ` (the sides differ before their final replies: there is no shared prompt to compare the
  replies on), `identical_sides` (the same final reply on both sides: nothing to prefer);
- longer than `--max-tokens` (both sides together: a pair is packed whole into one row of `seq_len`):
  `--long-pairs drop` skips it (`too_long`, counted; a choice, so never a `--strict` stop), `refuse` (the
  default) stops the run naming its `file:line` (`pipeline`). A pair is never truncated: its replies are
  what is compared.
Content holding special-token text is kept as text (noted as `special_token_text`), as in chat data.
"""

from __future__ import annotations

import numpy as np

from olmo_ds.chat import ChatError
from olmo_ds.data.prepare.conversations import TOO_LONG, block_result, conversation_text, encoder_for, reason_of
from olmo_ds.data.prepare.readers import PREFERENCE_FIELDS as SIDES

# Reasons of this module, beside the reader's (`readers.load_preference_block`) and the chat encoder's.
NOT_A_LIST = "side_not_a_list"
EMPTY_REPLY = "empty_reply"
PROMPTS_DIFFER = "prompts_differ"
IDENTICAL = "identical_sides"


def check_pair(chosen, rejected) -> tuple[str, str] | None:
    """Why a record's two sides cannot be a pair before either is encoded (`(reason, detail)`), or None."""
    for side, messages in zip(SIDES, (chosen, rejected)):
        if not isinstance(messages, list):
            return NOT_A_LIST, f"{side} is {type(messages).__name__}, not a list of messages"
    return None


def compare_pair(chosen: list, rejected: list) -> tuple[str, str] | None:
    """Why two encodable sides are not a pair (`(reason, detail)`), or None: the final replies must hold text
    and differ, and every message before them must be the same."""
    for side, messages in zip(SIDES, (chosen, rejected)):
        if not messages[-1]["content"].strip():
            return EMPTY_REPLY, f"{side}'s final reply is empty"
    if chosen[:-1] != rejected[:-1]:
        if len(chosen) != len(rejected):
            return PROMPTS_DIFFER, f"chosen has {len(chosen) - 1} messages before its reply, rejected {len(rejected) - 1}"
        i = next(i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b)
        return PROMPTS_DIFFER, f"message {i} differs"
    if chosen[-1] == rejected[-1]:
        return IDENTICAL, "the final replies are the same"
    return None


def compare_tokens(c_ids: np.ndarray, c_mask: np.ndarray, r_ids: np.ndarray, r_mask: np.ndarray) -> tuple[str, str] | None:
    """The pair as the loader and `validate_shards.py` see it: the sides' ids are the same up to their first
    trained token, which is at the same place, and differ after it. Messages that compare equal give that
    under any template that renders content as given; one that does not is caught here."""
    first = int(np.argmax(c_mask))
    if first != int(np.argmax(r_mask)) or not np.array_equal(c_ids[:first], r_ids[:first]):
        return PROMPTS_DIFFER, "the template renders the shared messages differently on the two sides"
    if np.array_equal(c_ids, r_ids):
        return IDENTICAL, "the two sides encode to the same ids"
    return None


def encode_pairs(spec, tokenizer, records: list, base: int, dtype: np.dtype):
    """`records` (line, (chosen, rejected), reason) of one block → (lines kept, tokens, doc_lens, mask, skips,
    special_at lines, notes, texts for the split hash), as `conversations.encode_records` gives them, with
    two documents (chosen, rejected) per kept line. Skips are `(base + line, reason, detail)`."""
    enc = encoder_for(spec, tokenizer)
    skips = [(base + line, reason, "") for line, pair, reason in records if pair is None]
    candidates = []
    for line, pair, _ in records:
        if pair is None:
            continue
        problem = check_pair(*pair)
        if problem is not None:
            skips.append((base + line, *problem))
            continue
        candidates.append((line, pair))
    encoded = enc.encode_batch([side for _, pair in candidates for side in pair]) if candidates else []
    lines, ids, masks, special, texts = [], [], [], [], []
    limit = spec.max_tokens
    for k, (line, (chosen, rejected)) in enumerate(candidates):
        got = encoded[2 * k:2 * k + 2]
        bad = next(((side, e) for side, e in zip(SIDES, got) if isinstance(e, ChatError)), None)
        if bad is not None:
            skips.append((base + line, reason_of(bad[1]), f"{bad[0]}: {bad[1].reason}"))
            continue
        c, r = got
        problem = compare_pair(chosen, rejected) or compare_tokens(c.ids, c.mask, r.ids, r.mask)
        if problem is not None:
            skips.append((base + line, *problem))
            continue
        if limit and len(c.ids) + len(r.ids) > limit:
            skips.append((base + line, TOO_LONG, f"{len(c.ids) + len(r.ids):,} tokens (chosen {len(c.ids):,} + rejected "
                                                 f"{len(r.ids):,}) > --max-tokens {limit:,}"))
            continue
        lines.append(line)
        ids += [c.ids, r.ids]
        masks += [c.mask, r.mask]
        if c.escaped or r.escaped:
            special.append(line)
        if spec.val_fraction > 0:
            texts.append(conversation_text({"chosen": chosen, "rejected": rejected}))
    return block_result(lines, ids, masks, skips, special, [], texts, dtype)
