"""The package's walls (docs/architecture.md), checked on every import statement, function-local ones included.

- eval, model and data import nothing from train; model imports nothing from data;
- the shard format and the read path (olmo_ds.data outside data/prepare/) import nothing from the offline pipeline (data/prepare/);
- the checkpoint layer imports only `olmo_ds.atomic` and `olmo_ds.model.config` (and itself); `atomic`, `hub` and `ranks` import nothing of olmo_ds;
- RL (olmo_ds/train/rl/) is reached from the rest of the package only through `olmo_ds.train.objective` (and the tools);
- nothing under olmo_ds/ builds a path to, or runs, a file under scripts/ (messages may name a command).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "olmo_ds"

# room -> olmo_ds modules it must not import (a prefix matches the module and everything under it);
# a module inside a banned room may import its own room (data/prepare/ is inside data)
FORBIDDEN = {
    "olmo_ds.eval": ["olmo_ds.train", "olmo_ds.tools", "olmo_ds.cli"],
    "olmo_ds.model": ["olmo_ds.train", "olmo_ds.data", "olmo_ds.eval", "olmo_ds.checkpoint", "olmo_ds.weights", "olmo_ds.tools", "olmo_ds.cli"],
    "olmo_ds.weights": ["olmo_ds.train", "olmo_ds.data", "olmo_ds.eval", "olmo_ds.tools", "olmo_ds.cli"],
    "olmo_ds.data": ["olmo_ds.data.prepare", "olmo_ds.train", "olmo_ds.eval", "olmo_ds.tools", "olmo_ds.cli"],
    "olmo_ds.train": ["olmo_ds.tools", "olmo_ds.cli"],
}
# low layers: the only olmo_ds modules they may import
ALLOWED_ONLY = {
    "olmo_ds.checkpoint": ["olmo_ds.checkpoint", "olmo_ds.atomic", "olmo_ds.model.config", "olmo_ds"],
    "olmo_ds.atomic": [],
    "olmo_ds.hub": [],
    "olmo_ds.ranks": [],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, module) of every olmo_ds import in the file, wherever the statement is."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from olmo_ds import checkpoint`, `from olmo_ds.data import prepare` import the submodule
            found += [(node.lineno, f"{node.module}.{a.name}") if node.module == "olmo_ds" or is_module(f"{node.module}.{a.name}")
                      else (node.lineno, node.module) for a in node.names]
    return [(line, m) for line, m in found if m == "olmo_ds" or m.startswith("olmo_ds.")]


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


SOURCES = sorted(PACKAGE.rglob("*.py"))


def breaches(path: Path, source: str | None = None) -> list[str]:
    me = module_name(path)
    bad = []
    for line, target in imports_of(path, path.read_text() if source is None else source):
        for room, banned in FORBIDDEN.items():
            if under(me, room) and any(under(target, b) and not under(me, b) for b in banned):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {room} imports {target}")
        for room, allowed in ALLOWED_ONLY.items():
            if under(me, room) and not any(target == a or (a != "olmo_ds" and under(target, a)) for a in allowed):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {room} may import only {allowed or 'nothing of olmo_ds'}, imports {target}")
    return bad


def test_the_walls_hold():
    bad = [b for path in SOURCES for b in breaches(path)]
    assert not bad, "imports across the package's walls:\n" + "\n".join(bad)


def rl_breaches(path: Path, source: str | None = None) -> list[str]:
    """Imports of olmo_ds.train.rl from outside it, other than by the objective (the trainer's one door) and the tools."""
    me = module_name(path)
    if under(me, "olmo_ds.train.rl") or me == "olmo_ds.train.objective" or under(me, "olmo_ds.tools"):
        return []
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: {me} imports {target} (reach RL through olmo_ds.train.objective)"
            for line, target in imports_of(path, path.read_text() if source is None else source) if under(target, "olmo_ds.train.rl")]


def test_rl_is_reached_only_through_the_objective():
    bad = [b for path in SOURCES for b in rl_breaches(path)]
    assert not bad, "\n".join(bad)
    assert rl_breaches(PACKAGE / "train" / "trainer.py", "from olmo_ds.train.rl.rollout import Sample\n")
    assert not rl_breaches(PACKAGE / "train" / "objective.py", "from olmo_ds.train.rl import rl_objective\n")


def test_the_check_catches_function_local_imports():
    """The check must see an import inside a function, where every earlier breach was."""
    fake = PACKAGE / "model" / "_wall_probe.py"
    assert breaches(fake, "def f():\n    from olmo_ds.data.shards import MANIFEST\n") == [
        "olmo_ds/model/_wall_probe.py:2: olmo_ds.model imports olmo_ds.data.shards"]
    assert breaches(PACKAGE / "checkpoint" / "_probe.py", "import olmo_ds.eval.tasks\n")


@pytest.mark.parametrize("source", [
    "from olmo_ds.data.prepare.pipeline import prepare\n",
    "def f():\n    from olmo_ds.data.prepare import readers\n",
    "from olmo_ds.data import prepare\n",
    "import olmo_ds.data.prepare.pool\n",
])
def test_the_read_path_may_not_import_the_offline_pipeline(source):
    """The wall between data/ and data/prepare/ must be able to fail, in each way an import can name it;
    inside data/prepare/ the same import is the room's own."""
    found = breaches(PACKAGE / "data" / "_probe.py", source)
    assert len(found) == 1 and "olmo_ds.data imports olmo_ds.data.prepare" in found[0], found
    assert breaches(PACKAGE / "data" / "prepare" / "_probe.py", source) == []


def path_literals_to_scripts(path: Path, source: str | None = None) -> list[str]:
    """String constants that are a path into scripts/ ("scripts", "scripts/x.py"): messages have spaces, paths do not."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if (text == "scripts" or text.startswith(("scripts/", "./scripts/"))) and " " not in text:
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {text!r}")
    return hits


def test_nothing_in_the_package_runs_a_script_by_path():
    hits = [h for path in SOURCES for h in path_literals_to_scripts(path)]
    assert not hits, "the package reaches into scripts/ (start `python -m olmo_ds.cli.NAME` or call the function instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("source", ['ROOT / "scripts" / "pretrain.py"', 'cmd = ["scripts/pretrain.py"]'])
def test_the_script_check_catches_paths(source):
    assert path_literals_to_scripts(PACKAGE / "tools" / "_probe.py", source)


def local_package_imports(path: Path, source: str | None = None) -> list[str]:
    """olmo_ds imports inside a function or method: the package's own modules are imported at the top, where a reader
    sees what a module depends on (tools/ may defer theirs, to time what they import)."""
    hits = []
    for fn in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                hits += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {n}" for n in names if n == "olmo_ds" or n.startswith("olmo_ds.")]
    return hits


# Modules whose olmo_ds imports wait on purpose, and why (besides tools/).
DEFERS_IMPORTS = {"olmo_ds.cli.prepare_data": "fastokens starts parsing the tokenizer before the pipeline is imported (olmo_ds.fast_parse)",
                  "olmo_ds.cli.pretrain": "its last exit handler (end_process) is registered before torch and DeepSpeed register theirs"}


def test_the_package_imports_its_own_modules_at_the_top():
    hits = [h for path in SOURCES if not under(module_name(path), "olmo_ds.tools") and module_name(path) not in DEFERS_IMPORTS
            for h in local_package_imports(path)]
    assert not hits, "function-local imports of olmo_ds modules (move them to the module's top):\n" + "\n".join(sorted(set(hits)))


def test_the_local_import_check_can_fail():
    assert local_package_imports(PACKAGE / "data" / "_probe.py", "def f():\n    if x:\n        from olmo_ds.chat import MASKS\n") == [
        "olmo_ds/data/_probe.py:3: olmo_ds.chat"]
