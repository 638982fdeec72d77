"""What makes the numbers: optimizers and learning-rate schedules, mixed precision, the loss scaler,
and the optional NVIDIA apex paths."""
