"""The built-in model families: each module builds one (or a few related) from its config;
its torch-free facts (``*_facts``, ``formulas``) are what the registry and the planner read."""
