"""Worker with the training hook (which opens its stack-dump file); rank argv[1] SIGKILLs itself, the others
wait to be stopped."""
import os
import signal
import sys
import time

import trainguard

trainguard.init()
if os.environ["RANK"] == sys.argv[1]:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
