"""``python -m planner.profile model=...``: measures the model's layers on this device and writes a
per-layer profile (``planner.inputs.profile``) for the planner."""
import sys

from planner.calibrate.measure import main

if __name__ == "__main__":
    sys.exit(main())
