"""The models trained: the policy's forward and update, the critic, kernels, LoRA, FSDP2, the tiny policy."""
