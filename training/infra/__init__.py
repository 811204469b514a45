"""Training infrastructure: torch.distributed and FSDP2 plumbing, checkpoints, GPU memory checks, metrics and alarms."""
