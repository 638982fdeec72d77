"""The chosen plan replayed in the runtime's schedule simulator (flush and asynchronous schedules)."""
