"""Conversations to ids and loss masks (olmo_ds/chat.py), against OLMo-core's own SFT sample and transformers."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from olmo_ds.chat import OLMO3_TEMPLATE, ChatEncoder, ChatError, ChatTemplate, check_messages, load_chat_template
from olmo_ds.tokenizer import load_tokenizer

from testdata import SHARED

TOKENIZERS = SHARED / "tokenizers"
CHAT = SHARED / "data" / "chat-sample"
OLMOCORE = SHARED / "data" / "olmocore-sft-sample"
IM_START, IM_END, EOS, PAD = 100264, 100265, 100257, 100277


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZERS / "dolma2-tokenizer.json")


@pytest.fixture(scope="module")
def olmo3():
    return load_chat_template("olmo3")


@pytest.fixture(scope="module")
def train_rows():
    return [json.loads(line) for line in (CHAT / "train.jsonl").read_text(encoding="utf-8").splitlines()]


def read_olmocore_sample():
    """ids, mask and {conversation id: (start, end)} of the converter's output (rows shuffled, seed 42)."""
    ids = np.fromfile(OLMOCORE / "token_ids_part_0000.npy", dtype=np.uint32)
    mask = np.fromfile(OLMOCORE / "labels_mask_part_0000.npy", dtype=np.bool_)
    index = [json.loads(line) for line in (OLMOCORE / "sample_index.jsonl").read_text().splitlines()]
    return ids, mask, {r["id"]: (r["start"], r["end"]) for r in index}


def test_builtin_olmo3_is_the_published_template(olmo3):
    config = json.loads((TOKENIZERS / "olmo3-instruct-tokenizer_config.json").read_text())
    assert OLMO3_TEMPLATE == config["chat_template"]
    from_config = load_chat_template(TOKENIZERS / "olmo3-instruct-tokenizer_config.json")
    assert from_config.text == olmo3.text and from_config.tokens == olmo3.tokens
    assert olmo3.tokens == {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    # the converter's own tokenizer directory (tokenizer_config.json with chat_template) loads the same template
    assert load_chat_template(OLMOCORE / "tokenizer").text == olmo3.text


def test_all_270_conversations_give_olmocore_sample_ids_and_masks_exactly(tok, olmo3, train_rows):
    ids, mask, where = read_olmocore_sample()
    assert len(where) == len(train_rows) == 270
    encoded = ChatEncoder(olmo3, tok).encode_batch([r["messages"] for r in train_rows])
    total = 0
    for row, got in zip(train_rows, encoded):
        assert not isinstance(got, ChatError), (row["id"], got)
        start, end = where[row["id"]]
        assert got.ids.dtype == np.uint32 and got.mask.dtype == np.bool_
        np.testing.assert_array_equal(got.ids, ids[start:end], err_msg=row["id"])
        np.testing.assert_array_equal(got.mask, mask[start:end], err_msg=row["id"])
        total += got.targets
    assert total == int(mask.sum()) == 36_995


def test_jinja_file_and_tokenizer_config_sources_render_alike(tok, olmo3, tmp_path, train_rows):
    (tmp_path / "t.jinja").write_text(OLMO3_TEMPLATE, encoding="utf-8")
    from_file = load_chat_template(tmp_path / "t.jinja", tok)
    assert from_file.tokens["eos_token"] == "<|endoftext|>"
    a, b = ChatEncoder(from_file, tok), ChatEncoder(olmo3, tok)
    for row in train_rows[:20]:
        np.testing.assert_array_equal(a.encode(row["messages"]).ids, b.encode(row["messages"]).ids)


def test_ids_equal_transformers_apply_chat_template(tok, olmo3, train_rows):
    transformers = pytest.importorskip("transformers")
    config = json.loads((TOKENIZERS / "olmo3-instruct-tokenizer_config.json").read_text())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZERS / "dolma2-tokenizer.json"),
                                              chat_template=config["chat_template"], eos_token=config["eos_token"],
                                              bos_token=config["bos_token"], pad_token=config["pad_token"])
    enc = ChatEncoder(olmo3, tok)
    for row in train_rows:
        want = hf.apply_chat_template(row["messages"], tokenize=True)["input_ids"]
        assert enc.encode(row["messages"]).ids.tolist() == want, row["id"]
    # Where content holds special-token text transformers forges a turn; we keep it as text.
    forged = next(json.loads(x) for x in (CHAT / "bad.jsonl").read_text().splitlines() if "special-token-text-user" in x)
    theirs = hf.apply_chat_template(forged["messages"], tokenize=True)["input_ids"]
    ours = enc.encode(forged["messages"]).ids.tolist()
    assert theirs.count(IM_START) == ours.count(IM_START) + 1 and theirs.count(IM_END) == ours.count(IM_END) + 2
    assert tok.decode(ours) == hf.decode(theirs)  # the same text either way


def test_prefix_rendering_path_agrees_on_a_template_that_changes_content(tok, olmo3, train_rows):
    """A template that trims content cannot be put back by position: it takes open-instruct's prefix
    rendering path, which must give the same ids and masks on this (untrimmed-equal) data."""
    trimming = ChatTemplate("trimming", OLMO3_TEMPLATE.replace("message['content']", "(message['content'] | trim)"), olmo3.tokens)
    fast, slow = ChatEncoder(olmo3, tok), ChatEncoder(trimming, tok)
    for row in train_rows[:60]:
        a, b = fast.encode(row["messages"]), slow.encode(row["messages"])
        np.testing.assert_array_equal(a.ids, b.ids, err_msg=row["id"])
        np.testing.assert_array_equal(a.mask, b.mask, err_msg=row["id"])
    padded = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": " ok "}]
    assert tok.decode(slow.encode(padded).ids).endswith("user\nhi<|im_end|>\n<|im_start|>assistant\nok<|endoftext|>")
    # padded content with special-token text: trim changes it, so it cannot take the fast path, nor be kept as text
    with pytest.raises(ChatError, match="changes content"):
        slow.encode([{"role": "user", "content": " a <|im_end|> b "}, {"role": "assistant", "content": "c"}])


def bad_rows():
    return [json.loads(line) for line in (CHAT / "bad.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("row", bad_rows(), ids=lambda r: r["id"].removeprefix("chat-sample-bad-"))
def test_every_bad_conversation_is_handled_as_expected(tok, olmo3, row):
    enc = ChatEncoder(olmo3, tok)
    if row["expect"] == "reject":
        with pytest.raises(ChatError) as e:
            enc.encode(row["messages"])
        assert e.value.reason
        return
    got = enc.encode(row["messages"])
    assert got.ids[-1] == EOS and (got.ids == EOS).sum() == 1 and got.mask[-1] and not got.mask[0]
    if row["expect"] == "reject-or-escape":
        assert got.escaped
        # the special ids are exactly the template's own: one <|im_start|> per turn (plus the default system turn)
        turns = len(row["messages"]) + (0 if any(m["role"] == "system" for m in row["messages"]) else 1)
        assert (got.ids == IM_START).sum() == turns and (got.ids == IM_END).sum() == turns - 1 and (got.ids == PAD).sum() == 0
        assert "".join(m["content"] for m in row["messages"] if m["role"] == "assistant") in tok.decode(got.ids[got.mask])
        with pytest.raises(ChatError, match="special-token text"):
            ChatEncoder(olmo3, tok, special_text="reject").encode(row["messages"])
    else:
        assert not got.escaped


def test_bad_reasons_name_the_problem(tok, olmo3):
    reasons = {}
    for row in bad_rows():
        try:
            ChatEncoder(olmo3, tok).encode(row["messages"])
        except ChatError as e:
            reasons[row["id"].removeprefix("chat-sample-bad-")] = e.reason
    assert "unknown role 'narrator'" in reasons["unknown-role"]
    assert "'Assistant'" in reasons["role-wrong-case"] and "case-sensitive" in reasons["role-wrong-case"]
    assert "no 'role'" in reasons["missing-role"]
    assert "no 'content'" in reasons["missing-content"]
    assert "null" in reasons["null-content"]
    assert "list, not a string" in reasons["content-not-string"]
    assert "empty" in reasons["empty-messages"]
    assert "'user' turn" in reasons["ends-with-user"] and "'user' turn" in reasons["user-only"]
    assert "U+D83D" in reasons["lone-surrogate"]


def test_no_trained_token_and_template_errors_are_reasons(tok, olmo3):
    raising = ChatTemplate("raising", "{{ raise_exception('no tools here') }}", olmo3.tokens)
    with pytest.raises(ChatError, match="no tools here"):
        ChatEncoder(raising, tok).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    no_eos = ChatTemplate("no-eos", "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}", olmo3.tokens)
    with pytest.raises(ChatError, match="does not end with the EOS"):
        ChatEncoder(no_eos, tok).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    # A template that drops the assistant's content and closer leaves nothing to train.
    silent = ChatTemplate("silent", "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}{{ eos_token }}", olmo3.tokens)
    with pytest.raises(ChatError, match="no token is a training target"):
        ChatEncoder(silent, tok).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_loading_errors_name_the_file(tok, tmp_path):
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jinja: chat template line \d"):
        load_chat_template(tmp_path / "bad.jinja", tok)
    with pytest.raises(ValueError, match="names no eos_token"):
        load_chat_template(tmp_path / "bad.jinja")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    with pytest.raises(ValueError, match="no 'chat_template'"):
        load_chat_template(tmp_path / "tokenizer_config.json")
    with pytest.raises(FileNotFoundError, match="not a built-in"):
        load_chat_template("olmo9")
    with pytest.raises(ValueError, match="chat mask 'some'"):
        ChatEncoder(load_chat_template("olmo3"), tok, mask="some")


def tokens_of(tok, encoded, mask):
    return [tok.decode([i]) for i in encoded.ids[mask]]


def test_masks_assistant_all_last(tok, olmo3):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"}]
    got = {m: ChatEncoder(olmo3, tok, mask=m).encode(messages) for m in ("assistant", "all", "last")}
    assert all(np.array_equal(got[m].ids, got["all"].ids) for m in got)
    assert tokens_of(tok, got["assistant"], got["assistant"].mask) == ["Hello", "<|im_end|>", "C", "iao", "<|endoftext|>"]
    assert tokens_of(tok, got["last"], got["last"].mask) == ["C", "iao", "<|endoftext|>"]
    trained_all = "".join(tokens_of(tok, got["all"], got["all"].mask))
    assert trained_all == ("Be brief. You do not currently have access to any functions. <functions></functions><|im_end|>"
                           "Hi<|im_end|>Hello<|im_end|>Bye<|im_end|>Ciao<|endoftext|>")
    for m in got.values():  # never a header, never the '\n' after <|im_end|>, never the first token
        ids = m.ids
        assert not m.mask[0] and not m.mask[ids == IM_START].any()
        after_end = np.flatnonzero(ids == IM_END) + 1
        assert not m.mask[after_end].any()
    # without a system message, the template's default system turn is not a message and never trained
    default = ChatEncoder(olmo3, tok, mask="all").encode(messages[1:])
    assert "".join(tokens_of(tok, default, default.mask)) == "Hi<|im_end|>Hello<|im_end|>Bye<|im_end|>Ciao<|endoftext|>"


def test_check_messages_accepts_extra_roles_when_asked():
    messages = [{"role": "user", "content": "x"}, {"role": "environment", "content": "y"}, {"role": "assistant", "content": "z"}]
    with pytest.raises(ChatError, match="unknown role 'environment'"):
        check_messages(messages)
    check_messages(messages, roles=("system", "user", "assistant", "environment"))


def test_rendering_is_linear_in_turns(tok, olmo3, monkeypatch):
    """Two renders per conversation and one tokenizer call per batch, however many turns."""
    enc = ChatEncoder(olmo3, tok)
    renders, calls = [], []
    real_render, real_batch = ChatTemplate.render, enc._tok.encode_batch
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **k: renders.append(1) or real_render(self, *a, **k))
    monkeypatch.setattr(enc, "_tok", _Counting(enc._tok, calls))
    long = [m for i in range(200) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})]
    got = enc.encode_batch([long, long[:2], long[:40]])
    assert len(renders) == 6 and len(calls) == 1
    assert got[0].targets == sum(len(tok.encode(f"a{i}")) + 1 for i in range(200))


class _Counting:
    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls

    def encode_batch(self, *a, **k):
        self._calls.append(1)
        return self._inner.encode_batch(*a, **k)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_speed_per_thousand_conversations(tok, olmo3, train_rows):
    enc = ChatEncoder(olmo3, tok)
    conversations = [r["messages"] for r in train_rows] * 4
    start = time.perf_counter()
    enc.encode_batch(conversations)
    per_k = (time.perf_counter() - start) / len(conversations) * 1000
    tokens = 122_657 * 4
    print(f"\nchat encode: {per_k:.2f} s per 1K conversations ({tokens / (per_k * len(conversations) / 1000):,.0f} tokens/s)")
    assert per_k < 20
