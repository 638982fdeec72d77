"""The searches: PTD-P, PipeDream-2BW, PipeDream's hierarchical DP, pinned degrees, ranking, and
``auto``, which picks one and assembles the plan."""
