"""Training: the loop, optimizer and schedules, loss, checkpoints, metrics and MFU."""
