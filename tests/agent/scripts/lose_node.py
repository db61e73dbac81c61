"""Worker whose node is lost in the job's first generation: GROUP_RANK 1 SIGKILLs its launcher (the node's
trainguard run, as the OOM killer or a dying host would end it); every other worker, and every worker of a later
generation, records its environment as dump_env.py does."""
import os
import runpy
import signal
import sys
import time

if os.environ["GROUP_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)  # the launcher's end takes this worker down with it
    sys.exit(1)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "dump_env.py"), run_name="__main__")
