"""Fixtures of the evaluation tests (helpers live in eval_testlib.py, importable by name)."""

import pytest

from eval_testlib import DOLMA2, NEOX, tiny_olmo
from olmo_ds.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def neox():
    return load_tokenizer(NEOX)


@pytest.fixture(scope="session")
def dolma2():
    return load_tokenizer(DOLMA2)


@pytest.fixture(scope="session")
def model(neox):
    return tiny_olmo(neox.vocab_size)
