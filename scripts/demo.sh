#!/usr/bin/env bash
# The whole pipeline on an embedded corpus, no downloads: `make demo` runs this inside .venv.
#   1. a sample corpus from the Python standard library (docstrings + source)
#   2. a 4096-id byte-level BPE tokenizer trained on it
#   3. `make prepare-data`: token shards (5% held out for validation), then validation
#   4. 2-rank DeepSpeed ZeRO-3 pretraining of a tiny OLMo-2 (CPU accelerator + gloo without a GPU)
#   5. `bash scripts/eval.sh` on the final checkpoint: validation perplexity and bits-per-byte
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO_DIR=${DEMO_DIR:-data/demo}
RUN_DIR=${RUN_DIR:-runs/demo}
start=$(date +%s)
step() { printf '\n==> %s\n' "$*"; }

step "1/5 sample corpus → $DEMO_DIR/raw"
[ -f "$DEMO_DIR/raw/prose.jsonl" ] || python scripts/make_sample_corpus.py --output "$DEMO_DIR/raw"

step "2/5 tokenizer → $DEMO_DIR/tokenizer.json"
[ -f "$DEMO_DIR/tokenizer.json" ] || python scripts/train_tokenizer.py --input "$DEMO_DIR/raw" --vocab-size 4096 --output "$DEMO_DIR/tokenizer.json"

step "3/5 make prepare-data → $DEMO_DIR/shards"
make --no-print-directory prepare-data INPUT="$DEMO_DIR/raw" TOKENIZER="$DEMO_DIR/tokenizer.json" OUTPUT="$DEMO_DIR/shards" \
  PREPARE_ARGS="--val-fraction 0.05 --overwrite"

step "4/5 deepspeed --hostfile hostfile scripts/pretrain.py --config configs/demo.yaml"
rm -rf "$RUN_DIR"
python scripts/make_hostfile.py  # `make hostfile`: localhost slots=<GPUs> (2 CPU ranks without); keeps an existing one
# With a hostfile, DeepSpeed's launcher first runs `ssh localhost hostname`; one machine needs no
# ssh server, so skip that check and rendezvous on the loopback address.
deepspeed --hostfile hostfile --no_ssh_check --master_addr 127.0.0.1 scripts/pretrain.py \
  --config configs/demo.yaml --set run_dir="$RUN_DIR"

step "5/5 bash scripts/eval.sh $RUN_DIR"
bash scripts/eval.sh "$RUN_DIR" --out "$RUN_DIR/eval"

python - "$RUN_DIR" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
from pathlib import Path
run, seconds = Path(sys.argv[1]), int(sys.argv[2])
rows = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "train/loss" in r]
first, last = rows[0], rows[-1]
print(f"\nDemo finished in {seconds // 60} min {seconds % 60} s.")
print(f"  training loss: {first['train/loss']:.3f} at step {first['step']} → {last['train/loss']:.3f} at step {last['step']}")
print(f"  checkpoint:    {(run / 'checkpoints' / 'latest').read_text().strip()} under {run}/checkpoints/")
print(f"  evaluation:    {run}/eval/results.json")
print(f"  TensorBoard:   tensorboard --logdir {run}/tb")
PY
