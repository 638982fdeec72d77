"""What the tests share: harnesses that train or plan in-process or on local ranks, fixtures and
catalogues of cases, and the process probe (process_probe/, put on PYTHONPATH by processes.py)."""
