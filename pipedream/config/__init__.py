"""The typed run configuration: the Hydra config checked once into a frozen ``RunSpec`` (``run_spec``,
``specs``, ``precision``, ``harmony``), the parallel layout, the plan file and how configs are loaded.
Torch-free: the launcher and the planner import it before any process starts."""
