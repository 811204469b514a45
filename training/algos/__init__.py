"""Training algorithms of the search-agent papers, as pure functions (advantages, losses, rewards, rollout plans)."""
