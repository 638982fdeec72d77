"""``python -m planner.calibrate``: measures this machine and writes a cluster sheet."""
import sys

from planner.calibrate.sheet import main

sys.exit(main())
