"""Worker that sleeps (and forks a grandchild that sleeps) until it is stopped."""
import subprocess
import sys
import time

subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("sleeping", flush=True)
time.sleep(120)
