"""Worker whose rank given in argv[1] exits with code argv[2] after a short while; others wait to be stopped."""
import os
import sys
import time

if os.environ["RANK"] == sys.argv[1]:
    time.sleep(0.2)
    sys.exit(int(sys.argv[2]))
time.sleep(60)
