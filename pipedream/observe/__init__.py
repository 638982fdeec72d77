"""What a run shows: traces and their clocks, the trace report and timeline plots, metrics, peak
FLOP/s for MFU, and the run directory's outputs."""
