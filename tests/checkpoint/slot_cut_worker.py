"""Child of test_ckpt_slot_truncated: the node agent's memory tier scans a slot that another process cuts short
once the tier has opened it. Run in its own process: a SIGBUS there must fail the test, not kill pytest.

Usage: slot_cut_worker.py ROOT CUT_TO  (CUT_TO < 0: no cut). Prints ``listed=<steps> corrupt=<n>``.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from trainguard.agent.memory_tier import MemoryTier
from trainguard.checkpoint import arena as arena_mod


def main() -> None:
    root, cut_to = sys.argv[1], int(sys.argv[2])
    name = "open_locked" if hasattr(arena_mod, "open_locked") else "open_readonly"  # the latter: before the fix
    real = getattr(arena_mod, name)

    def opened_then_cut(paths: arena_mod.SlotPaths) -> Any:
        opened = real(paths)
        if cut_to >= 0:  # another process (truncate(1)) cuts the slot while the tier holds it open
            subprocess.run(["truncate", "-s", str(cut_to), paths.data], check=True)
        return opened

    setattr(arena_mod, name, opened_then_cut)
    tier = MemoryTier(root, "job", "/ckpt")
    held = tier.scan()
    print(f"listed={[h.step for h in held]} corrupt={tier.corrupt}", flush=True)


if __name__ == "__main__":
    main()
