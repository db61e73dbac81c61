"""The predictor's online part (what the node agent imports every interval) never loads the offline part
(training, trace generation, the CLI) nor scikit-learn: see predictor/README.md, "Layout"."""

from __future__ import annotations

import json
import subprocess
import sys

OFFLINE = ("trainguard.predictor.training", "trainguard.predictor.tracegen", "trainguard.predictor.cli", "sklearn",
           "torch")


def test_online_imports_stay_online() -> None:
    code = ("import json, sys\n"
            "import trainguard.predictor.online_feed, trainguard.predictor.runtime, trainguard.predictor.history\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(done.stdout))
    assert "trainguard.predictor.online_feed" in loaded
    leaked = sorted(m for m in loaded if m.split(".")[0] in OFFLINE or m in OFFLINE)
    assert leaked == [], f"the online predictor imports offline modules: {leaked}"
