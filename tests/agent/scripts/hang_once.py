"""Worker that reports steps through the hook; rank 1 stops stepping at step 5 of the first generation."""
import os
import time

import trainguard

session = trainguard.init()
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
for step in range(12):
    if first and step == 5 and os.environ["RANK"] == "1":
        time.sleep(600)  # hung: alive, but no more progress
    time.sleep(0.05)
    session.step_done(step)
session.close()
