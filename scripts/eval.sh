#!/usr/bin/env bash
# Evaluate a checkpoint, run or exported model; see `python scripts/eval.py --help`.
#
#   bash scripts/eval.sh [CHECKPOINT|RUN|EXPORT_DIR] [--tasks ...] [--data ...] [--out DIR]
#
# One process on CPU or one GPU; with NPROC=N (or N visible GPUs when NPROC is unset) the
# evaluation set is split over N ranks by torchrun, with the same results as one rank.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

PY=python
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi

if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi

if [ "$NPROC" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "$ROOT/scripts/eval.py" "$@"
fi
exec "$PY" "$ROOT/scripts/eval.py" "$@"
