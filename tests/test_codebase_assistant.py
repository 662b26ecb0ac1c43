"""The codebase assistant (examples/codebase_assistant/): its script syncs a package's source into a store and
answers routed questions; its IDE configurations, read as the tools read them, reach a real `cartridges serve` on
127.0.0.1 through the real openai client (as Continue and Aider call it) and a real MCP client session."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import anyio
import openai
import pytest
import yaml
from mcp import ClientSession, StdioServerParameters, stdio_client

from cartridges_sdk import CartridgeStore, load_model
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import ServeConfig
from cartridges_sdk.testing import serving

APP = Path(__file__).resolve().parent.parent / "examples" / "codebase_assistant"
KEY = "sk-local-codebase"  # the key the configurations carry
SOURCE = {
    "__init__.py": '"""A small HTTP client."""\nfrom ._client import Client\n',
    "_client.py": 'class Client:\n    """Sends requests over a pool of connections and follows redirects."""\n\n'
                  '    def send(self, request):\n        """Send a request and return its response."""\n',
    "_auth.py": 'class BasicAuth:\n    """Adds a basic Authorization header built from a username and a password."""\n',
}


def _assistant():
    spec = importlib.util.spec_from_file_location("codebase_assistant", APP / "assistant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama):
    """The app run once on a small package with the tiny model (saved as a folder: the app loads what it is given)."""
    root = tmp_path_factory.mktemp("app")
    model = root / "tiny"
    tiny_llama.model.save_pretrained(model)
    tiny_llama.tokenizer.save_pretrained(model)
    source = root / "client"
    for name, text in SOURCE.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    (source / "__pycache__").mkdir()
    (source / "__pycache__" / "_client.cpython-311.pyc").write_bytes(b"\x00\x01")
    return root, model, source, root / "store"


def run_app(built, capsys, *extra: str) -> str:
    root, model, source, store = built
    _assistant().main(["--source", str(source), "--model", str(model), "--store", str(store), "--tokens", "24",
                       "--max-tokens", "4", *extra])
    return capsys.readouterr().out


def test_the_app_syncs_the_source_and_answers_routed_questions_naming_their_module(built, capsys, tiny_llama):
    out = run_app(built, capsys, "--question", "How does BasicAuth build the Authorization header?", "--compare")
    assert "sync: added 3, updated 0, skipped 0 (unchanged), deleted 0, rejected 0" in out  # the cache is no module
    store = CartridgeStore(built[3], tiny_llama)
    version = store.records()["_auth.py"]["sha256"]
    assert f"from _auth.py ({version[:12]})" in out and "source in context (" in out
    # the answer is the store's own, routed the same way
    want = store.ask("How does BasicAuth build the Authorization header?", max_new_tokens=4).text.strip()
    assert re.search(r"cartridge \([\d.]+ s, from _auth.py \(\w+\)\): (.*)", out).group(1) == want
    # an edit rebuilds its module only
    (built[2] / "_client.py").write_text(SOURCE["_client.py"] + "\n    def close(self):\n        pass\n")
    out = run_app(built, capsys, "--question", "What does Client send?")
    assert "sync: added 0, updated 1, skipped 2 (unchanged), deleted 0" in out and "from _client.py (" in out
    with pytest.raises(ConfigError, match="'no_such_package_here' is not an installed package"):
        _assistant().main(["--package", "no_such_package_here"])


@pytest.fixture(scope="module")
def served(built, tiny_llama):
    lm = load_model(str(built[1]))  # the app's store is bound to the model it was built with
    store = CartridgeStore(built[3], lm)
    with serving(create_app(store, lm.get_runtime("hf"), ServeConfig(api_key=KEY))) as url:
        yield url, store, lm


def _here(url: str, configured: str) -> str:
    """A configuration's API base, pointed at the test's port (the files say 127.0.0.1:8000)."""
    assert configured == "http://127.0.0.1:8000/v1"
    return url


def test_continue_and_aider_reach_the_server_as_configured(built, capsys, served):
    url, store, lm = served
    question = "How does BasicAuth build the Authorization header?"
    want = store.ask(question, max_new_tokens=8).text
    # Continue: provider openai, apiBase, model "auto"; it sends a system turn, text parts, and streams
    model = yaml.safe_load((APP / "ide" / "continue-config.yaml").read_text())["models"][0]
    assert model["provider"] == "openai" and model["roles"] == ["chat"]
    client = openai.OpenAI(base_url=_here(url, model["apiBase"]), api_key=model["apiKey"], max_retries=0)
    chunks = client.chat.completions.create(
        model=model["model"], stream=True, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "You are a helpful coding assistant."},
                  {"role": "user", "content": [{"type": "text", "text": question}]}])
    chunks = list(chunks)
    assert chunks[0].model_extra["cartridges"] == ["_auth.py"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # an answer, streamed
    assert model["defaultCompletionOptions"]["maxTokens"] <= ServeConfig().max_new_tokens
    # Aider: openai-api-base, and "openai/auto" (LiteLLM drops the provider prefix before the request)
    aider = yaml.safe_load((APP / "ide" / "aider.conf.yml").read_text())
    assert aider["model"].startswith("openai/") and aider["edit-format"] == "ask"
    client = openai.OpenAI(base_url=_here(url, aider["openai-api-base"]), api_key=aider["openai-api-key"],
                           max_retries=0)
    got = client.chat.completions.create(model=aider["model"].removeprefix("openai/"), max_tokens=8, temperature=0,
                                         messages=[{"role": "user", "content": question}])
    assert got.choices[0].message.content == want and got.model_extra["cartridges"] == ["_auth.py"]
    assert got.model_extra["versions"] == [store.records()["_auth.py"]["sha256"]]


def test_an_mcp_client_configured_by_the_files_asks_the_codebase(served):
    url, store, _ = served
    configured = json.loads((APP / "ide" / "mcp.json").read_text())["mcpServers"]["codebase"]
    continued = yaml.safe_load((APP / "ide" / "continue-config.yaml").read_text())["mcpServers"][0]
    assert (continued["command"], continued["args"], continued["env"]) == (
        configured["command"], configured["args"], configured["env"])
    args = copy.copy(configured["args"])
    args[args.index("--base-url") + 1] = _here(url, args[args.index("--base-url") + 1])
    # the client starts `cartridges` as the file says; here it is the one installed beside this Python
    command = shutil.which(configured["command"], path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    params = StdioServerParameters(command=command, args=args, env=configured["env"])

    async def ask():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return await session.call_tool("ask_codebase", {"question": "What does Client send?"})

    result = anyio.run(ask)
    version = store.records()["_client.py"]["sha256"]
    assert not result.is_error and result.content[0].text.endswith(f"Sources: _client.py ({version[:12]})")
