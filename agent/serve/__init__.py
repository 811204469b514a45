"""sleuth serve: the agent as a question-answering server (/ask, OpenAI-compatible chat, the browser page)."""
