"""One rank of a launch whose host claims `sys.argv[1]` GPUs: runs the launch checks as the trainer does.

Started by the real deepspeed launcher (tests/train/test_launch_checks.py), so the checks read the
environment that launcher exports; exits 2 with the error, as scripts/pretrain.py does.
"""

import os
import sys

from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.launch import detect_environment
from olmo_ds.ranks import LaunchError
from olmo_ds.train.preflight import check_launch

gpus = int(sys.argv[-1])  # after the launcher's --local_rank=N
env = detect_environment()
cfg = config_from_dict({"model": {"preset": "tiny"}, "data": {"sources": [{"path": "unused"}]},
                        "batch": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32}}, source="worker.yaml")
try:
    check_launch(cfg, env.rank, env.local_rank, env.world_size, visible_gpus=gpus, host_gpus=gpus)
except (ConfigError, LaunchError) as e:
    print(f"error: rank {env.rank}: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
print(f"rank {env.rank} of {env.world_size} passed (LOCAL_SIZE={os.environ.get('LOCAL_SIZE')})", flush=True)
