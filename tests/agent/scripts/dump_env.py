"""Worker that records its torchrun-style environment, joins a gloo group, and exits 0."""
import json
import os
import sys

import torch.distributed as dist

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "TRAINGUARD_AGENT_SOCKET", "TRAINGUARD_GENERATION", "OMP_NUM_THREADS"]
dist.init_process_group("gloo")
out = {k: os.environ.get(k) for k in KEYS}
out["dist_rank"] = dist.get_rank()
out["dist_world"] = dist.get_world_size()
with open(os.path.join(sys.argv[1], f"env{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
