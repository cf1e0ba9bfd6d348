"""`prepare_data.py --format rl`: RLVR rows → prompt shards with a ground-truth sidecar, with every format's guarantees
(any worker count, resume after a kill, a validation split), every kind of bad row skipped under its own reason with
its file:line or refused under --strict; the sample generator and the committed fixtures.

On the fixture set (tests/data/rl_fixtures, written by scripts/make_rl_prompts.py), the real dolma2 tokenizer and
OLMo 3's template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.chat import ChatEncoder, load_chat_template
from olmo_ds.data import shards
from olmo_ds.data.prepare import rl_prompts
from olmo_ds.data.prepare.pipeline import PrepareConfig, PrepareError, prepare
from olmo_ds.data.validate import format_report, validate_directory
from olmo_ds.eval import verifiers
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
FIXTURES = Path(__file__).resolve().parent / "rl_fixtures"
MAX_TOKENS = 256  # the fixtures' bad.jsonl holds one prompt longer than this


def run(inputs, out, **kw):
    kw.setdefault("chunk_bytes", 1024)  # many blocks, so that worker pools really interleave
    kw.setdefault("progress", False)
    kw.setdefault("chat_template", "olmo3")
    kw.setdefault("check_ground_truth", verifiers.check)
    return prepare(PrepareConfig(inputs=[str(i) for i in inputs], output=out, tokenizer=str(DOLMA2), format="rl", **kw), log=lambda _: None)


def read_prompts(directory: Path) -> list[tuple[list[int], dict]]:
    """(ids, sidecar record) of every document of a prompt shard directory, in order."""
    out = []
    for b in shards.list_shards(directory):
        meta = shards.ShardMeta.load(b.with_suffix(".json"))
        ids, offsets = np.asarray(shards.open_tokens(b, meta)), shards.load_offsets(directory / meta.offsets)
        records = shards.read_prompt_records(directory / meta.prompts, meta)
        out += [(ids[a:e].tolist(), r) for a, e, r in zip(offsets[:-1], offsets[1:], records)]
    return out


def dir_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def many_rows(directory: Path, copies: int = 6) -> Path:
    """The fixtures' train rows with bad.jsonl among them, several files."""
    directory.mkdir(parents=True)
    train, bad = (FIXTURES / "train.jsonl").read_bytes(), (FIXTURES / "bad.jsonl").read_bytes()
    for k in range(copies):
        (directory / f"prompts-{k}.jsonl").write_bytes(train + (bad if k == 2 else b""))
    return directory


def test_each_row_is_its_prompt_with_the_generation_prompt_and_its_ground_truth(tmp_path):
    result = run([FIXTURES / "train.jsonl"], tmp_path / "out")
    rows = [json.loads(line) for line in (FIXTURES / "train.jsonl").read_text().splitlines()]
    enc = ChatEncoder(load_chat_template("olmo3", load_tokenizer(str(DOLMA2))), load_tokenizer(str(DOLMA2)))
    got = read_prompts(tmp_path / "out")
    assert result.num_docs == len(rows) == len(got) == 36
    for i, (row, (ids, record)) in enumerate(zip(rows, got)):
        assert ids == enc.encode_prompt(row["messages"])
        assert record == {"source": f"{FIXTURES / 'train.jsonl'}:{i + 1}", "verifier": verifiers.check(row["dataset"], row["ground_truth"]),
                          "dataset": row["dataset"], "ground_truth": row["ground_truth"]}
    text = load_tokenizer(str(DOLMA2)).decode(got[0][0])
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>user\n") == 1
    m = shards.Manifest.load(tmp_path / "out")
    assert m.prompts and not m.masked and m.extra["format"] == "rl"
    assert m.extra["verifiers"] == {"gsm8k": 24, "ifeval": 8, "math": 4}
    report = validate_directory(tmp_path / "out", load_tokenizer(str(DOLMA2)))
    assert report.ok, format_report(report)
    assert "36 RL prompts" in format_report(report)


def test_same_bytes_for_any_worker_count(tmp_path):
    raw = many_rows(tmp_path / "raw")
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        run([raw], out, shard_tokens=3000, val_fraction=0.2, workers=workers, max_tokens=MAX_TOKENS)
        outs[workers] = dir_bytes(out)
    assert any(k.startswith("val/") and k.endswith(".prompts.jsonl") for k in outs[1])
    assert len([k for k in outs[1] if k.endswith(".prompts.jsonl")]) > 4
    assert outs[2] == outs[1]


def test_compressed_input_gives_the_same_bytes(tmp_path):
    import gzip

    zipped = tmp_path / "raw" / "train.jsonl.gz"
    zipped.parent.mkdir()
    zipped.write_bytes(gzip.compress((FIXTURES / "train.jsonl").read_bytes()))
    plain = tmp_path / "raw" / "train.jsonl"
    plain.write_bytes((FIXTURES / "train.jsonl").read_bytes())
    run([plain], tmp_path / "plain", val_fraction=0.2)
    run([zipped], tmp_path / "zipped", val_fraction=0.2)
    strip = lambda d: {k: v.replace(b"train.jsonl.gz:", b"train.jsonl:") for k, v in dir_bytes(d).items() if k.endswith(".prompts.jsonl")}
    assert strip(tmp_path / "zipped") == strip(tmp_path / "plain")
    for name in ("shard-00000.bin", "shard-00000.offsets.npy", "val/shard-00000.bin"):
        assert (tmp_path / "zipped" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


def test_the_validation_split_keeps_each_prompt_with_its_ground_truth(tmp_path):
    run([FIXTURES / "train.jsonl"], tmp_path / "out", val_fraction=0.3)
    train, val = read_prompts(tmp_path / "out"), read_prompts(tmp_path / "out" / "val")
    assert len(train) + len(val) == 36 and 3 < len(val) < 25
    whole = {r["source"]: (ids, r) for ids, r in read_prompts(_single(tmp_path))}
    for ids, r in train + val:
        assert whole[r["source"]] == (ids, r)
    assert validate_directory(tmp_path / "out").ok


def _single(tmp_path: Path) -> Path:
    run([FIXTURES / "train.jsonl"], tmp_path / "whole")
    return tmp_path / "whole"


def test_every_bad_row_is_skipped_under_its_own_reason_with_file_and_line(tmp_path):
    result = run([FIXTURES / "train.jsonl", FIXTURES / "bad.jsonl"], tmp_path / "out", max_tokens=MAX_TOKENS)
    assert result.num_docs == 36
    want = {}
    for reason, _ in rl_prompts.bad_lines(MAX_TOKENS):
        want[reason] = want.get(reason, 0) + 1
    skipped = shards.Manifest.load(tmp_path / "out").extra["skipped"]
    assert skipped["counts"] == want
    for line, (reason, _) in enumerate(rl_prompts.bad_lines(MAX_TOKENS), start=1):
        assert any(e.startswith(f"{FIXTURES / 'bad.jsonl'}:{line}") for e in skipped["examples"][reason]), (reason, line)


def test_strict_stops_at_the_first_bad_row_naming_file_line_and_reason(tmp_path):
    rows = (FIXTURES / "train.jsonl").read_bytes().splitlines(keepends=True)
    bad = dict((reason, line) for reason, line in reversed(rl_prompts.bad_lines(MAX_TOKENS)))
    for reason in ("unknown_verifier", "missing_ground_truth", "bad_ground_truth", "prompt_too_long"):
        src = tmp_path / f"{reason}.jsonl"
        src.write_bytes(b"".join(rows[:5]) + bad[reason] + b"\n" + b"".join(rows[5:]))
        with pytest.raises(PrepareError, match=rf"{src}:6: {reason.replace('_', ' ')}.*--strict"):
            run([src], tmp_path / f"out-{reason}", strict=True, max_tokens=MAX_TOKENS)
        assert not (tmp_path / f"out-{reason}" / "manifest.json").exists()


def test_resume_after_a_crash_is_byte_identical(tmp_path):
    raw = many_rows(tmp_path / "raw")
    ref, out = tmp_path / "ref", tmp_path / "out"
    run([raw], ref, shard_tokens=3000, val_fraction=0.2, max_tokens=MAX_TOKENS)
    expected = dir_bytes(ref)
    n = len(shards.list_shards(ref))
    assert n > 4
    shutil.copytree(ref, out)
    (out / "manifest.json").unlink()
    for k in range(2, n):
        for p in out.glob(f"{shards.shard_stem(k)}.*"):
            p.unlink()
    shards.prompts_path(out, 2).with_name("shard-00002.prompts.jsonl.tmp").write_bytes(b'{"half": ')  # a writer killed mid-shard
    (out / "shard-00003.bin").write_bytes(b"\0" * 8)
    result = run([raw], out, shard_tokens=3000, val_fraction=0.2, max_tokens=MAX_TOKENS)
    assert result.resumed_from is not None
    assert dir_bytes(out) == expected


def test_a_damaged_sidecar_fails_validation(tmp_path):
    run([FIXTURES / "train.jsonl"], tmp_path / "out")
    path = shards.prompts_path(tmp_path / "out", 0)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))
    report = validate_directory(tmp_path / "out")
    assert not report.ok and "checksum mismatch" in format_report(report)
    (tmp_path / "out" / "shard-00000.prompts.jsonl").unlink()
    assert "missing prompt records shard-00000.prompts.jsonl" in format_report(validate_directory(tmp_path / "out"))
    run([FIXTURES / "train.jsonl"], tmp_path / "edited")  # an edited line whose checksum was updated too
    path, meta_file = shards.prompts_path(tmp_path / "edited", 0), tmp_path / "edited" / "shard-00000.json"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = b'{"source": "x:5", "ground_truth": "7"}\n'
    path.write_bytes(b"".join(lines))
    meta = json.loads(meta_file.read_text())
    meta["prompts_checksum"] = shards.sha256_file(path)
    meta_file.write_text(json.dumps(meta))
    assert "shard-00000.prompts.jsonl:5: not a prompt record (a JSON object with 'verifier' and 'ground_truth')" in format_report(
        validate_directory(tmp_path / "edited"))
    run([FIXTURES / "train.jsonl"], tmp_path / "again")
    manifest = json.loads((tmp_path / "again" / "manifest.json").read_text())
    manifest["verifiers"]["gsm8k"] += 1
    (tmp_path / "again" / "manifest.json").write_text(json.dumps(manifest))
    assert "manifest.json: verifiers {'gsm8k': 25, 'ifeval': 8, 'math': 4} != sum over the shards' metadata" in format_report(
        validate_directory(tmp_path / "again"))


def test_flags_that_mean_nothing_for_prompts_are_refused_by_name(tmp_path):
    src = FIXTURES / "train.jsonl"
    for kw, said in [({"chat_mask": "all"}, "--mask"), ({"max_tokens": 100, "long_conversations": "truncate"}, "--long-conversations"),
                     ({"partition": (0, 2)}, "--partition"), ({"work_unit": "files"}, "--work-unit files"),
                     ({"check_ground_truth": None}, "needs a ground-truth check"), ({"text_field": "prompt"}, "--text-field")]:
        with pytest.raises(PrepareError, match=said):
            run([src], tmp_path / "out", **kw)
    txt = tmp_path / "prompts.txt"
    txt.write_text("What is 1 + 1?\n")
    with pytest.raises(PrepareError, match=rf"{txt}: --format rl reads JSON lines"):
        run([txt], tmp_path / "out")


def test_rerun_after_sigkill_is_byte_identical(tmp_path):
    import signal
    import time

    raw = tmp_path / "raw"
    raw.mkdir()
    rows = rl_prompts.mixed_rows(600, 200, 100, seed=5)
    for k in range(3):
        rl_prompts.write_jsonl(raw / f"prompts-{k}.jsonl", rows[k * 300:(k + 1) * 300])
    args = ["--format", "rl", "--chat-template", "olmo3", "--input", str(raw), "--tokenizer", str(DOLMA2), "--shard-tokens", "2000",
            "--no-progress", "--val-fraction", "0.1", "--max-tokens", str(MAX_TOKENS)]
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run([sys.executable, "scripts/prepare_data.py", *args, "--output", str(ref)], cwd=REPO, check=True, capture_output=True)
    proc = subprocess.Popen([sys.executable, "scripts/prepare_data.py", *args, "--output", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(out.glob("shard-*.json"))) < 8 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    r = subprocess.run([sys.executable, "scripts/prepare_data.py", *args, "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert dir_bytes(out) == dir_bytes(ref)
    assert validate_directory(out).ok


def test_the_generator_is_deterministic_and_its_rows_are_scorable(tmp_path):
    rl_prompts.write_fixtures(tmp_path / "fx")
    for name in rl_prompts.FIXTURE_FILES:
        assert (tmp_path / "fx" / name).read_bytes() == (FIXTURES / name).read_bytes(), f"{name}: rerun scripts/make_rl_prompts.py --fixtures --force"
    assert rl_prompts.mixed_rows(10, 5, 5, seed=3) == rl_prompts.mixed_rows(10, 5, 5, seed=3) != rl_prompts.mixed_rows(10, 5, 5, seed=4)
    task = rl_prompts.Arithmetic(10, 99, "*")
    for row, chat in zip(task.rows(50, seed=7), task.chat(50, seed=7)):
        assert row["messages"][0] == chat["messages"][0]
        a, b = (int(x) for x in row["messages"][0]["content"].removeprefix("What is ").rstrip("?").split(" * "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["ground_truth"] == str(a * b)
        assert verifiers.reward(row["dataset"], chat["messages"][1]["content"], row["ground_truth"]).score == 1.0
        assert verifiers.reward(row["dataset"], "The answer is 1.", row["ground_truth"]).score == 0.0
    for row in rl_prompts.ifeval_rows(20, 1) + rl_prompts.math_rows(20, 1):
        verifiers.check_ground_truth(row["dataset"], row["ground_truth"])
    for row in rl_prompts.math_rows(10, 2):
        assert verifiers.reward(row["dataset"], "so \\boxed{" + row["ground_truth"] + "}", row["ground_truth"]).score == 1.0
        assert verifiers.reward(row["dataset"], "so \\boxed{" + row["ground_truth"] + "+1}", row["ground_truth"]).score == 0.0
    with pytest.raises(ValueError, match="operation"):
        rl_prompts.Arithmetic(operation="/")


def test_code_rows_are_prepared_and_their_reference_solutions_pass(tmp_path):
    """`make_rl_prompts.py --task code` rows through `prepare_data.py --format rl` (the real command line): every row kept
    with its tests; the reference solution of each scores 1 by the code verifier and a wrong one less."""
    rows_path = tmp_path / "code.jsonl"
    made = subprocess.run([sys.executable, "scripts/make_rl_prompts.py", "--task", "code", "--count", "12", "--seed", "4", "--output", str(rows_path)],
                          cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    out = tmp_path / "out"
    prep = subprocess.run([sys.executable, "scripts/prepare_data.py", "--format", "rl", "--chat-template", "olmo3", "--input", str(rows_path),
                           "--tokenizer", str(DOLMA2), "--output", str(out), "--no-progress", "--strict"], cwd=REPO, capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    got = read_prompts(out)
    assert len(got) == len(rows) == 12 and shards.Manifest.load(out).extra["verifiers"] == {"code": 12}
    for row, (_, record) in zip(rows, got):
        assert record["verifier"] == "code" and record["ground_truth"] == row["ground_truth"]
    assert len({r["messages"][0]["content"].split("`")[1] for r in rows}) > 3  # several tasks
    for row in rows[:4]:
        assert verifiers.reward("code", rl_prompts.reference_solution(row), row["ground_truth"]) == verifiers.Reward(1.0)
        assert verifiers.reward("code", "```python\ndef nothing():\n    pass\n```", row["ground_truth"]).score == 0.0


def test_make_rl_prompts_never_writes_over_a_file_without_force(tmp_path):
    target = tmp_path / "prompts.jsonl"
    target.write_text("mine\n")
    cmd = [sys.executable, "scripts/make_rl_prompts.py", "--task", "code", "--count", "3", "--output", str(target)]
    refused = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and target.read_text() == "mine\n"
    assert f"--output {target} exists; prompts are never written over a file (remove it, name another, or pass --force)" in refused.stderr
    assert subprocess.run(cmd + ["--force"], cwd=REPO, capture_output=True).returncode == 0
    assert len(target.read_text().splitlines()) == 3
    (tmp_path / "fx").mkdir()
    (tmp_path / "fx" / "code.jsonl").write_text("mine\n")
    refused = subprocess.run([sys.executable, "scripts/make_rl_prompts.py", "--fixtures", str(tmp_path / "fx")], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and f"--fixtures {tmp_path / 'fx' / 'code.jsonl'} exists" in refused.stderr
    assert not (tmp_path / "fx" / "train.jsonl").exists()
