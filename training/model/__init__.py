"""The models being trained: the policy's forward and update, the critic, the fused kernels' bindings, LoRA, FSDP2 sharding, the tiny policy."""
