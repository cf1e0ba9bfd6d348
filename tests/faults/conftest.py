"""Prints the fault report at the end of any session that ran fault tests (see faultlib.py)."""

from __future__ import annotations

from tests.faults import faultlib
from tests.faults.coverage import OWNER_TESTS


def _owner_rows(stats: dict) -> list[faultlib.Row]:
    """Bad-input kinds the owners' tests cover, counted from this session's reports (call phase)."""
    reports = [r for outcome in ("passed", "failed") for r in stats.get(outcome, []) if getattr(r, "when", None) == "call"]
    rows = []
    for fault, node_ids in OWNER_TESTS.items():
        mine = [r for r in reports if any(r.nodeid == n or r.nodeid.startswith(n + "[") for n in node_ids)]
        if mine:
            rows.append(faultlib.Row(fault, len(mine), sum(r.passed for r in mine), 0, "owner tests"))
    return rows


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = list(faultlib.RESULTS.values())
    if not rows:
        return
    rows += _owner_rows(terminalreporter.stats)
    terminalreporter.section(f"fault report ({faultlib.MODE} run, OLMO_DS_FAULT_SEED={faultlib.SEED})")
    terminalreporter.write_line(faultlib.format_table(rows))
