"""Training infrastructure: torch.distributed, checkpoints, GPU memory checks, metrics and alarms."""
