"""The RL algorithms: rewards, advantage estimators and their registry, turn credit, losses, off-policy."""
