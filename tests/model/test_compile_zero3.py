"""Compiled blocks under real DeepSpeed ZeRO-3 at rows of any shape: one graph set for all 16 layers, a bounded
number of graphs for any number of row shapes, and the gradients of eager blocks.

One CPU rank in a subprocess (compile_zero3_worker.py; inductor compiles for the CPU with gcc). The engine runs
with DeepSpeed's default `memory_efficient_linear`, under which torch 2.11's dynamo guarded every compiled block
on its layer's `ds_id` (through DeepSpeed's linear): 16 layers gave 8 graphs, dynamo's recompile limit, and the
blocks ran eagerly from then on (the RL benchmark's training on an H100, issue 59). Four row shapes (rows x
length, a batch of one among them) each train and score (DPO's reference pass); a graph per shape would be 4 per
function, a graph per layer 8. The bound, 3 per function, is `model._RowShapedCompile`'s: the first shape's static
graph, a batch of one, and one with dynamic rows for the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ds.train.launch import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_compiled_blocks_under_zero3_compile_a_bounded_number_of_graphs_for_any_layer_and_row_shape():
    worker = Path(__file__).with_name("compile_zero3_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(free_port())], capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("COMPILE_ZERO3 ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[0].removeprefix("COMPILE_ZERO3 "))

    assert result["linear_replaced"]  # zero.Init put DeepSpeed's linear in place of torch's, process-wide
    assert result["training_graphs"] <= 3 and result["scoring_graphs"] <= 3, result
    # every block call of the engine compiled (16 layers x 4 shapes, training and scoring); the copy's ran eagerly
    assert result["block_calls"] == {"compiled": 16 * 4 * 2, "eager": 16 * 4 * 2}, result["block_calls"]
    assert result["loss_diff"] <= 1e-5 and result["grad_diff"] <= 1e-4 and result["logprob_diff"] <= 1e-4, result
    # only a leaf block with its weights gathered takes the compiled path
    assert result["routes"] == {"not_leaf": False, "leaf": True, "leaf_released": False}, result["routes"]
