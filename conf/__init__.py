"""Hydra configs (``config.yaml``, ``planner.yaml`` and their groups). A package so that
``pip install .`` ships them next to ``pipedream``; see ``pipedream.config.loading``."""
