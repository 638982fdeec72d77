"""Measuring this machine: the cluster sheet (``sheet``, ``python -m planner.calibrate``), the runtime's
own costs and Harmony's, and per-layer model profiles (``measure``, ``python -m planner.profile``)."""
