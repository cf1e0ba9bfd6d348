"""Write sample RL prompts (JSON lines in the RLVR layout) for `prepare_data.py --format rl`, or the chat records
that teach the arithmetic task first (`--chat`, for `prepare_data.py --format chat`). Deterministic from --seed.

    python scripts/make_rl_prompts.py --task arithmetic --count 2000 --output data/rl/train.jsonl
    python scripts/make_rl_prompts.py --task arithmetic --count 2000 --chat --seed 1 --output data/rl/sft.jsonl
    python scripts/make_rl_prompts.py --task mixed --count 300 --output data/rl/mixed.jsonl
    python scripts/make_rl_prompts.py --task code --count 200 --output data/rl/code.jsonl
    python scripts/make_rl_prompts.py --fixtures tests/data/rl_fixtures --force

An existing file is never written over unless --force is given.

See olmo_ds/data/prepare/rl_prompts.py for the task families.
"""

import argparse
import sys
from pathlib import Path

from olmo_ds.data.prepare import rl_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("arithmetic", "ifeval", "math", "code", "mixed"), default="arithmetic",
                   help="arithmetic (verifier gsm8k, default), ifeval, math, code (Python functions with assert tests), "
                        "or mixed (half arithmetic, a third ifeval, the rest math)")
    p.add_argument("--count", type=int, default=1000, help="rows to write (default: 1000)")
    p.add_argument("--seed", type=int, default=0, help="the random seed: the same seed writes the same rows (default: 0)")
    p.add_argument("--low", type=int, default=0, help="arithmetic: smallest operand (default: 0)")
    p.add_argument("--high", type=int, default=9, help="arithmetic: largest operand (default: 9)")
    p.add_argument("--operation", choices=tuple(rl_prompts.OPERATIONS), default="+", help="arithmetic: the operation (default: +)")
    p.add_argument("--answer-format", default=rl_prompts.ANSWER_FORMAT, help=f"--chat: the assistant's reply, holding {{result}} (default: {rl_prompts.ANSWER_FORMAT!r})")
    p.add_argument("--chat", action="store_true", help="arithmetic: write chat records (question and answer) for supervised fine-tuning instead of prompts")
    p.add_argument("--output", help="the JSON-lines file to write")
    p.add_argument("--fixtures", metavar="DIR", help="write the test fixture set (train, val, bad, sft, code .jsonl) to DIR instead")
    p.add_argument("--force", action="store_true", help="write over existing output files")
    a = p.parse_args(argv)
    if not a.force:
        existing = [Path(a.fixtures) / name for name in rl_prompts.FIXTURE_FILES] if a.fixtures else [Path(a.output)] if a.output else []
        for path in existing:
            if path.exists():
                p.error(f"{'--fixtures' if a.fixtures else '--output'} {path} exists; prompts are never written over a file "
                        "(remove it, name another, or pass --force)")
    if a.fixtures:
        for name, n in rl_prompts.write_fixtures(a.fixtures).items():
            print(f"{a.fixtures}/{name}: {n} rows")
        return 0
    if not a.output:
        p.error("--output FILE is needed (or --fixtures DIR)")
    if a.count < 1:
        p.error(f"--count must be >= 1, got {a.count}")
    if a.chat and a.task != "arithmetic":
        p.error(f"--chat writes arithmetic question-answer records; --task is {a.task}")
    try:
        arithmetic = rl_prompts.Arithmetic(a.low, a.high, a.operation, a.answer_format)
    except ValueError as e:
        p.error(str(e))
    if a.chat:
        rows = arithmetic.chat(a.count, a.seed)
    elif a.task == "arithmetic":
        rows = arithmetic.rows(a.count, a.seed)
    elif a.task == "ifeval":
        rows = rl_prompts.ifeval_rows(a.count, a.seed)
    elif a.task == "math":
        rows = rl_prompts.math_rows(a.count, a.seed)
    elif a.task == "code":
        rows = rl_prompts.code_rows(a.count, a.seed)
    else:
        n_if = a.count // 3
        n_ar = (a.count + 1) // 2
        rows = rl_prompts.mixed_rows(n_ar, n_if, a.count - n_ar - n_if, a.seed, arithmetic)
    print(f"{a.output}: {rl_prompts.write_jsonl(a.output, rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
