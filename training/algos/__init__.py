"""The RL algorithms: rewards, advantage estimators and their registry, turn-level credit, policy losses, off-policy correction."""
