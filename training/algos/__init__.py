"""The RL algorithms: rewards, advantage estimators and their registry, turn credit, losses, off-policy
correction, and the search-agent papers' methods (ARPO, AEPO, E-GRPO, REX-RAG, IKEA/AdaSearch, SSRL, behaviour
priming, search self-play)."""
