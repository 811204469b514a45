"""An agent as people write it: LangChain's ReAct agent (``langchain.agents.create_agent``, a LangGraph graph that
alternates a model node and a tool node), its ``ChatOpenAI`` and a search tool over Sleuth's retriever. Nothing
in it knows about training: Sleuth runs it with the base URL of its training proxy, which records every token
the policy samples (``agent.kind=external``, ``agent.entry=examples.react_agent:answer``); pointed at any
OpenAI-compatible server it runs as it is.

The index it searches is ``$SLEUTH_INDEX`` (default ``runs/index``, what ``sleuth quickstart`` builds).
"""

from __future__ import annotations

import functools
import os
import threading

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

PROMPT = ("Answer the user's question. Call the search tool whenever you lack knowledge; you may call it as many "
          "times as you need. When you know the answer, reply with the answer only, inside <answer> and </answer>.")


_LOAD = threading.Lock()  # tools run in worker threads: the first searches must not load the index twice at once


def retriever():
    with _LOAD:
        return _retriever()


@functools.cache
def _retriever():
    from retrieval.index import load_retriever

    return load_retriever(os.environ.get("SLEUTH_INDEX", "runs/index"), "bm25")


@tool
def search(query: str) -> str:
    """Search the knowledge corpus (Wikipedia paragraphs) and return the top documents."""
    (hits,) = retriever().search([query], 3)
    return "\n".join(f"Doc {i}(Title: {h.title}) {h.text[:500]}" for i, h in enumerate(hits, start=1))


async def answer(question: str, base_url: str) -> str:
    """Run the agent on ``question`` with the chat model at ``base_url``; its last message is the answer."""
    model = ChatOpenAI(model="policy", base_url=base_url, api_key="unused", max_retries=0)
    agent = create_agent(model, [search], system_prompt=PROMPT)
    state = await agent.ainvoke({"messages": [("user", question)]}, {"recursion_limit": 9})
    return state["messages"][-1].content
