"""Cost models: closed-form time and memory (``closed_form``), zero-bubble schedules, equal-block
pipelines (``uniform``), collectives, and the runtime's measured costs. Torch-free."""
