"""LLM backends behind agent.llm.LLM: transformers, vLLM, an OpenAI-compatible server, a worker process, a fleet
of engine servers."""
