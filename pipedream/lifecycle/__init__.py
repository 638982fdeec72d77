"""A run's life beyond training steps: failures turned into one line, preemption and its watch."""
