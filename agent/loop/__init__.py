"""The LangGraph agent loop: its nodes and edges, the per-episode and batch graphs, the batching scheduler."""
