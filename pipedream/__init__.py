"""Pipeline-parallel training runtime (PipeDream, PipeDream-2BW/Flush, PTD-P schedules)."""
