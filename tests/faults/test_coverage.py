"""Every owner test the fault report counts (tests/faults/coverage.py) exists: `make test-faults` passes
their node ids to pytest, which stops with "file or directory not found" at the first moved one."""

from __future__ import annotations

import re

from tests.faults.coverage import OWNER_TESTS
from tests.faults.faultlib import ROOT


def test_every_owner_test_node_id_names_a_test_function():
    missing = []
    for node in sorted({n for ids in OWNER_TESTS.values() for n in ids}):
        path, _, name = node.partition("::")
        source = ROOT / path
        if not source.is_file() or not re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.MULTILINE):
            missing.append(node)
    assert not missing, f"tests/faults/coverage.py names tests that do not exist: {missing}"
