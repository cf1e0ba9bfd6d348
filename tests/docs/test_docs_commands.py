"""Every ```bash block in README.md and docs/*.md runs, so the docs cannot go stale.

Blocks run in document order (README first, then docs/ alphabetically) in one shared copy of the
working tree, so a guide may use what the README's tour made (data/my_shards, runs/mine). A block
holding a marker comment line — `# gpu-only`, `# multi-node` or `# not-run: <why>` — is only
checked with `bash -n`. Every block, run or not, must name only scripts, configs and make targets
that exist.

The copy gets its own `.venv` made of links into the real one with a fresh install stamp, so the
Makefile's install rule never fires there (it would re-point the shared editable install at the
temporary copy). Its `python` runs the real one: a venv python found through a linked `.venv` imports
torch and DeepSpeed by the copy's path, and DeepSpeed's op build, keyed by its include paths, would
then compile deepspeed_shm_comm again (~30 s, and again for every other test run after it).
"Your own text" for the README tour is the C4 sample from ../shared.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testdata import DOLMA2_HUB_ID, ROOT, SHARED, fill_hf_cache, pythonpath

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^\s*#\s*(gpu-only|multi-node|not-run\b)", re.M)
BLOCK_TIMEOUT_S = 300


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def bash_blocks(path: Path) -> list[tuple[int, str]]:
    """(1-based line of the opening fence, body) of every ```bash block."""
    blocks, body, start = [], None, 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if body is None and line.strip() == "```bash":
            body, start = [], n
        elif body is not None and line.strip() == "```":
            blocks.append((start, "\n".join(body) + "\n"))
            body = None
        elif body is not None:
            body.append(line)
    assert body is None, f"{path}:{start}: ```bash block never closed"
    return blocks


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-zA-Z_-]+):", text, re.M))


def check_references(where: str, body: str) -> None:
    """Scripts, ds_configs, tracked configs and make targets a block names must exist."""
    created = set(re.findall(r"cat > (\S+) <<", body))
    for ref in re.findall(r"(?<![\w/.])((?:scripts|ds_configs|configs)/[\w./-]+\.(?:py|sh|json|yaml|sbatch))", body):
        assert ref in created or (REPO / ref).exists(), f"{where}: names {ref}, which does not exist"
    targets = make_targets()
    for target in re.findall(r"(?:^|[;&|]\s*)make\s+(?:-\S+\s+)*([a-z][\w-]*)(?=\s|$)", body, re.M):
        assert target in targets, f"{where}: `make {target}` is not a Makefile target"


ALL_BLOCKS = [(f"{p.relative_to(REPO)}:{line}", body) for p in doc_files() for line, body in bash_blocks(p)]


@pytest.mark.parametrize("where,body", ALL_BLOCKS, ids=[w for w, _ in ALL_BLOCKS])
def test_block_syntax_and_references(where: str, body: str) -> None:
    result = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True)
    assert result.returncode == 0, f"{where}: bash -n: {result.stderr}"
    check_references(where, body)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(doc: Path) -> None:
    """Relative links point at files that exist, and #anchors at headings they have."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        assert dest.exists(), f"{doc.relative_to(REPO)}: link {target}: {file} does not exist"
        if anchor:
            assert anchor in anchors(dest), f"{doc.relative_to(REPO)}: link {target}: no heading with that anchor"


def copy_working_tree(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files, as a fresh clone plus this change would have."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def linked_venv(dest: Path) -> None:
    """A .venv whose contents link to the real one, with its own up-to-date install stamp. Its pythons are scripts
    that start the real venv's python by its own path, so every process sees the packages where the rest of the
    suite sees them (a link would make this .venv the prefix: the same files by another path)."""
    real = Path(sys.prefix)
    dest.mkdir()
    for entry in real.iterdir():
        if entry.name not in (".installed", "bin"):
            (dest / entry.name).symlink_to(entry)
    (dest / "bin").mkdir()
    for entry in (real / "bin").iterdir():
        if re.fullmatch(r"python[\d.]*", entry.name):
            (dest / "bin" / entry.name).write_text(f'#!/bin/sh\nexec {shlex.quote(str(entry))} "$@"\n')
            (dest / "bin" / entry.name).chmod(0o755)
        else:
            (dest / "bin" / entry.name).symlink_to(entry)
    (dest / ".installed").touch()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("docs")
    (root / "shared").symlink_to(SHARED.resolve())
    repo = root / "repo"
    repo.mkdir()
    copy_working_tree(repo)
    linked_venv(repo / ".venv")
    corpus = repo / "data" / "my_corpus"
    corpus.mkdir(parents=True)
    for f in sorted((SHARED / "data" / "c4-sample").glob("*.json.gz")):
        shutil.copy(f, corpus / f.name)
    # OLMo's tokenizer by hub id, as `hf download allenai/dolma2-tokenizer tokenizer.json` leaves it; offline.
    cache = root / "hf-cache"
    fill_hf_cache(cache, DOLMA2_HUB_ID, {"tokenizer.json": SHARED / "tokenizers" / "dolma2-tokenizer.json"})
    env = dict(os.environ)
    env.update(
        PATH=f"{repo / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(repo / ".venv"),
        PYTHONPATH=pythonpath(repo, drop=(ROOT,)),
        PYTHONUNBUFFERED="1",
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
    )
    prefix = subprocess.run(["python", "-c", "import sys; print(sys.prefix)"], cwd=repo, env=env, capture_output=True, text=True)
    assert prefix.stdout.strip() == sys.prefix, f"the copy's python runs in {prefix.stdout.strip()}, not {sys.prefix}"
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=repo, env=env)
    assert stamp.returncode == 0, "the copy's install stamp is stale: make would reinstall into the shared .venv"
    return repo, env


@pytest.mark.multirank
@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_doc_commands_run(doc: Path, workspace) -> None:
    repo, env = workspace
    for line, body in bash_blocks(doc):
        if MARKER.search(body):
            continue
        where = f"{doc.relative_to(REPO)}:{line}"
        try:
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", body], cwd=repo, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{where}: still running after {BLOCK_TIMEOUT_S} s\n{e.output}")
        assert result.returncode == 0, f"{where}: exit {result.returncode}\n{body}\n--- output ---\n{result.stdout[-6000:]}"
    if doc.name == "README.md":
        check_tour_promises(repo / "runs" / "mine")


def check_tour_promises(run: Path) -> None:
    """What the README says the tour leaves behind: a trained model, its evaluation, an export."""
    losses = [row["train/loss"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in row]
    assert losses and losses[-1] < losses[0] - 0.5, f"the tour's loss did not fall: {losses}"
    assert (run / "checkpoints" / "step-0000100" / "train_state.json").is_file()
    results = json.loads((run / "eval" / "step-0000100" / "results.json").read_text())
    assert results, "empty evaluation results"
    assert (run / "hf" / "config.json").is_file()


def test_make_help_lists_every_target() -> None:
    """`make help` has one line for each phony target (from its `## ` comment)."""
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    listed = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    names = re.findall(r"^\s+make (\S+)\s+\S", listed, re.M)
    assert sorted(names) == sorted(phony), f"make help lists {names}, .PHONY has {phony}"
