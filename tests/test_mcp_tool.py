"""`cartridges mcp`: a real MCP client session (the `mcp` package's stdio client) starts the bridge as a subprocess,
as an IDE does, and calls its tool, which asks a real `cartridges serve` on 127.0.0.1."""

from __future__ import annotations

import sys

import anyio
import openai
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from cartridges_sdk import Cartridge, CartridgeStore
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.serve.mcp_tool import render
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import BridgeConfig, ServeConfig
from cartridges_sdk.testing import free_port, serving

KEY = "sk-mcp-test"
TEXTS = {"_client.py": "class Client: sends requests over a pool of connections and follows redirects.",
         "_urls.py": "class URL: parses and normalises a URL into scheme, host, port and path.",
         "_auth.py": "class BasicAuth: adds a basic authorization header from a username and a password."}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama):
    store = CartridgeStore(tmp_path_factory.mktemp("store"), tiny_llama)
    for name, text in TEXTS.items():
        store.add(name, Cartridge.from_prefix(tiny_llama, text, 12), corpus=text)
    with serving(create_app(store, tiny_llama.get_runtime("hf"), ServeConfig(api_key=KEY))) as url:
        yield url


def session_calls(base_url: str, *calls: tuple[str, dict], key: str = KEY) -> tuple[list, list]:
    """Start the bridge over stdio as an MCP client does, list its tools and make `calls` in one session."""
    params = StdioServerParameters(command=sys.executable, args=[
        "-m", "cartridges_sdk.cli", "mcp", "--base-url", base_url, "--api-key", key, "--max-tokens", "8"])

    async def run():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = (await session.list_tools()).tools
            return tools, [await session.call_tool(name, arguments) for name, arguments in calls]

    return anyio.run(run)


def test_an_mcp_client_asks_the_server_through_the_bridge(served):
    question = "What does the Client send over a pool of connections?"
    tools, (ok, empty, lost) = session_calls(
        served, ("ask_codebase", {"question": question}), ("ask_codebase", {"question": "  "}),
        ("ask_codebase", {}))
    assert [t.name for t in tools] == ["ask_codebase"] and "codebase" in tools[0].description
    assert tools[0].input_schema["required"] == ["question"]
    # the tool's answer is the server's own routed answer, with its sources named
    direct = openai.OpenAI(base_url=served, api_key=KEY, max_retries=0).chat.completions.create(
        model="auto", messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0)
    assert direct.model_extra["cartridges"] == ["_client.py"]
    want = render({"answer": direct.choices[0].message.content, "cartridges": direct.model_extra["cartridges"],
                   "versions": direct.model_extra["versions"]})
    assert not ok.is_error and ok.content[0].text == want and want.endswith("Sources: _client.py")
    assert empty.is_error and "The question is empty" in empty.content[0].text
    assert lost.is_error and "question" in lost.content[0].text  # a missing argument is named


def test_the_bridge_says_what_went_wrong(served):
    (_, (refused,)) = session_calls(served, ("ask_codebase", {"question": "What does URL parse?"}), key="wrong")
    assert refused.is_error and "cartridges serve answered 401" in refused.content[0].text
    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    (_, (down,)) = session_calls(nowhere, ("ask_codebase", {"question": "What does URL parse?"}))
    assert down.is_error and f"Cannot reach cartridges serve at {nowhere}" in down.content[0].text
    with pytest.raises(ConfigError, match="base_url='localhost:8000' is not an http"):
        BridgeConfig(base_url="localhost:8000")
    with pytest.raises(ConfigError, match="tool='ask codebase' is not a tool name"):
        BridgeConfig(tool="ask codebase")
