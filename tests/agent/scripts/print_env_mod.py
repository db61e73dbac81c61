"""Worker that writes its whole environment to ``<out>/env<RANK>.json`` (no torch: the launchers' environments
are compared key by key by tests/agent/test_run_torchrun_compat.py)."""
import json
import os
import sys

out = sys.argv[-1]
with open(os.path.join(out, f"env{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv}, f)
