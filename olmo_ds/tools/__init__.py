"""Benchmarks and self-checks beside the core: `python -m olmo_ds.tools.NAME` (or `scripts/NAME.py`).

They call package functions, and where they need a fresh process they start one of the package's
own modules (`python -m olmo_ds.cli.pretrain`, ...), never a file under `scripts/`, so they work the
same from a clone and from an installed package, from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import olmo_ds


def package_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process that must import this same olmo_ds (a clone's or an installed one)."""
    env = dict(os.environ if environ is None else environ)
    root = str(Path(olmo_ds.__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
