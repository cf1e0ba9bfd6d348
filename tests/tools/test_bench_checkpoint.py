"""scripts/bench_checkpoint.py on CPU: one blocking save, background saves with the host memory allocated once,
a raw write of the same bytes, and the table printed last (the same code path as on a GPU, in seconds)."""

from __future__ import annotations

import json
import sys

from tests.train.train_testlib import ROOT, run


def test_cpu_run_reports_first_and_steady_background_saves_beside_a_raw_write(tmp_path):
    out = tmp_path / "result.json"
    proc = run([sys.executable, str(ROOT / "scripts" / "bench_checkpoint.py"), "--preset", "tiny", "--saves", "2",
                "--work-dir", str(tmp_path), "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [s["mode"] for s in r["saves"]] == ["blocking", "background", "background"]
    first, second = r["saves"][1:]
    assert first["alloc_s"] > 0 and second["alloc_s"] == 0, "the second background save allocated host memory again"
    assert all(s["bytes"] > 0 and 0 < s["blocked_s"] <= s["complete_s"] for s in r["saves"])
    assert r["raw_write_s"] > 0 and not list((tmp_path / "run" / "checkpoints").iterdir())
    table = proc.stdout.strip().splitlines()
    assert table[-1].startswith("steady state (background saves after the first): blocked <=")
    assert table[-2].startswith("raw write of the same bytes") and table[-3].startswith("background 2")
