"""Worker that, in generation 1, writes its pid to argv[1] and sleeps until killed; later generations exit 0."""
import os
import sys
import time

if os.environ["TRAINGUARD_GENERATION"] == "1":
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(120)
