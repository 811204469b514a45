"""Bad input around external agents gets a clear error: an ``agent.entry`` that does not exist or is of the wrong
form (a module or a ``path/to/file.py:function``), tools in a schema the proxy does not take (converted when
unambiguous, else refused naming the field, never dropped), and request fields ``sleuth serve`` cannot honour
for an external agent (refused) or can (temperature: honoured)."""

from __future__ import annotations

import httpx2
import pytest

from agent.external.proxy import Proxy, ProxyServer, ProxySettings
from agent.external.runner import ExternalRunner, load_entry
from agent.protocols.function_call import SEARCH_TOOL
from tests.chat_templates import CALLS, CHATML_TOOLS, Recording, ScriptedSampler

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
AGENT_FILE = '''
import helper_beside_it

async def answer(question, base_url):
    return helper_beside_it.WORD

def plain(question, base_url):
    return "x"

async def one_arg(question):
    return "x"
'''


@pytest.fixture()
def agent_file(tmp_path):
    (tmp_path / "helper_beside_it.py").write_text("WORD = 'from the file'\n")
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    return path


def test_an_entry_may_be_a_file_path_with_its_function(agent_file):
    import asyncio

    fn = load_entry(f"{agent_file}:answer")
    assert asyncio.run(fn("q", "u")) == "from the file"  # its sibling module imported too
    assert load_entry(f"{agent_file}:answer") is fn  # loaded once
    assert load_entry("examples.react_agent:answer").__name__ == "answer"


def test_bad_entries_get_errors_that_name_them(agent_file, tmp_path):
    with pytest.raises(ValueError, match=r"must be 'module:function' or 'path/to/file.py:function', got '.*my_agent.py'"):
        load_entry(str(agent_file))  # a file path without its function
    with pytest.raises(FileNotFoundError, match="no such file 'nowhere/agent.py'"):
        load_entry("nowhere/agent.py:answer")
    with pytest.raises(AttributeError, match="file '.*my_agent.py' has no 'nope'"):
        load_entry(f"{agent_file}:nope")
    with pytest.raises(ValueError, match="must be an async function .*plain is a plain function"):
        load_entry(f"{agent_file}:plain")
    with pytest.raises(ValueError, match=r"must take two arguments \(question, base_url\)"):
        load_entry(f"{agent_file}:one_arg")
    with pytest.raises(ImportError, match="agent.entry 'no_such_module_here:f': no module named 'no_such_module_here'"):
        load_entry("no_such_module_here:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_installed_anywhere\n")
    with pytest.raises(ImportError, match="loading .*broken.py' failed: ModuleNotFoundError: .*not_installed_anywhere"):
        load_entry(f"{broken}:answer")
    with pytest.raises(ValueError, match="must be 'module:function'"):
        load_entry("examples.react_agent:")


@pytest.mark.parametrize("entry", ["examples/react_agent.py", "examples.react_agent", ":answer", "x.py:1abc"])
def test_the_config_refuses_an_entry_of_the_wrong_form(entry):
    from sleuth.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="agent.entry: .*must be 'module:function' or 'path/to/file.py:function'"):
        load_config(None, [f"agent.entry={entry}"])
    assert load_config(None, ["agent.entry=examples/react_agent.py:answer"]).agent.entry == \
        "examples/react_agent.py:answer"


def test_runner_for_an_external_agent_without_an_entry_says_what_to_set(tiny_llm):
    from agent.external.runner import runner_for
    from sleuth.config import AgentConfig

    with pytest.raises(ValueError, match="needs agent.entry, 'module:function' or 'path/to/file.py:function'"):
        runner_for(tiny_llm, AgentConfig(kind="external"))


# -- tool schemas -------------------------------------------------------------------------------------
@pytest.fixture()
def proxy_http(tiny_llm):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    backend = Recording(ScriptedSampler(tiny_llm.tokenizer, [CALLS["chatml"], "<answer> Paris </answer>"]))
    proxy = Proxy(backend, ProxySettings(max_new_tokens=64, max_total_tokens=2000))
    with ProxyServer(proxy) as server, httpx2.Client(base_url=server.url, timeout=30) as http:
        yield proxy, http, tiny_llm.tokenizer


def test_anthropic_style_tools_are_converted_not_dropped(proxy_http):
    from agent.llm import decode

    proxy, http, tok = proxy_http
    fn = SEARCH_TOOL["function"]
    anthropic = {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
    r = http.post("/ep/a/v1/chat/completions", json={"messages": MSGS, "tools": [anthropic]})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]  # parsed as a call of a tool it was given
    assert call["function"]["name"] == "search"
    r = http.post("/ep/b/v1/chat/completions", json={"messages": MSGS, "tools": [SEARCH_TOOL]})
    assert r.status_code == 200, r.text
    converted, native = (decode(tok, proxy.take(ep).calls[0].prompt_ids) for ep in ("a", "b"))
    assert converted == native and '"input_schema"' not in converted and '"parameters"' in converted


@pytest.mark.parametrize(("body", "field", "reason"), [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": ["search"]}, "tools[0]", "must be an object"),
    ({"tools": [{"type": "function", "name": "search", "parameters": {}}]}, "tools[0].function",
     "legacy 'functions' entry"),
    ({"tools": [SEARCH_TOOL, {"type": "web_search"}]}, "tools[1].type", "only tools of type 'function'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "1-64"),
    ({"tools": [{"type": "function", "function": {"name": "s", "parameters": "a string"}}]},
     "tools[0].function.parameters", "JSON schema of type 'object'"),
    ({"tools": [{"name": "s", "input_schema": {"type": "array"}}]}, "tools[0].input_schema", "type 'object'"),
    ({"functions": [SEARCH_TOOL["function"]]}, "functions", "legacy form of tools"),
    ({"function_call": {"name": "search"}}, "function_call", "legacy form of tool_choice"),
    ({"tools": [SEARCH_TOOL], "tool_choice": "required"}, "tool_choice", "would force a tool call"),
    ({"tools": [SEARCH_TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice",
     "would force a tool call"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'auto' or 'none'"),
])
def test_tools_of_a_form_the_proxy_does_not_take_get_422_naming_the_field(proxy_http, body, field, reason):
    proxy, http, _ = proxy_http
    r = http.post("/ep/c/v1/chat/completions", json={"messages": MSGS, **body})
    assert r.status_code == 422, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith(field) and reason in msg, msg
    assert proxy.take("c").calls == []  # nothing was sampled or recorded


def test_a_call_after_its_episode_ended_gets_409(proxy_http):
    proxy, http, _ = proxy_http
    proxy.end("gone")
    r = http.post("/ep/gone/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 409 and r.json()["error"]["code"] == "episode_ended"
    assert http.post("/ep/other/v1/chat/completions", json={"messages": MSGS}).status_code == 200


# -- sleuth serve's request fields for an external agent ----------------------------------------------------
async def chat_agent(question: str, base_url: str) -> str:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                             temperature=1.7)  # the server's setting wins over the agent's
    return r.choices[0].message.content


def test_serve_honours_temperature_and_top_p_for_an_external_agent_and_refuses_max_tokens(tiny_llm, agent_cfg,
                                                                                         retriever):
    from agent.serve.app import create_app
    from tests.test_agent_fakes import ServerThread

    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    seen = []
    inner = tiny_llm.generate
    tiny_llm.generate = lambda prompts, params: (seen.append(params), inner(prompts, params))[1]
    cfg = agent_cfg.model_copy(update={"kind": "external"})
    with ExternalRunner(tiny_llm, chat_agent, cfg, temperature=0.0) as runner:
        app = create_app(tiny_llm, retriever, cfg, temperature=0.0, external=runner)
        with ServerThread(app) as server, httpx2.Client(base_url=server.url, timeout=60) as http:
            def chat(**fields):
                return http.post("/v1/chat/completions", json={"messages": MSGS, **fields})

            assert chat().status_code == 200
            assert (seen[-1].temperature, seen[-1].top_p) == (0.0, 1.0)  # the server's: greedy
            r = chat(temperature=0.8, top_p=0.5)
            assert r.status_code == 200, r.text
            assert (seen[-1].temperature, seen[-1].top_p) == (0.8, 0.5)  # the request's, for its episode
            before = len(seen)
            r = chat(temperature=0.6, n=2)  # two episodes (their calls may share one batch)
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
            assert len(seen) > before and {p.temperature for p in seen[before:]} == {0.6}
            assert chat().status_code == 200 and seen[-1].temperature == 0.0  # the next request: the server's again
            for field in ("max_tokens", "max_completion_tokens"):
                r = chat(**{field: 10})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "max_tokens" and "agent.kind=external" in err["message"]
            for field, value in (("temperature", 3), ("top_k", 2), ("max_turns", 99), ("seed", 1), ("tools", [SEARCH_TOOL])):
                r = chat(**{field: value})
                assert r.status_code in (400, 422) and field in r.json()["error"]["message"], (field, r.text)
    assert runner.proxy.settings.temperature == 0.0 and runner.proxy.sampling == {}
