"""`cartridges mcp`: a Model Context Protocol server whose one tool asks a running `cartridges serve`.

Why a bridge and not a second engine: an MCP client (an IDE, a desktop assistant) starts the servers it is
configured with itself, often one per window, over stdio. Loading the model in each would multiply its memory; the
bridge holds none. It sends each question to the one `cartridges serve` that holds the model and the store, routed
there (``model="auto"``), so every window shares that server's batching and cartridges, and a store kept in step
by ``serve --watch`` answers from the current code without the bridge knowing.
"""

from __future__ import annotations

from typing import Any

from ..errors import CartridgeError
from .settings import BridgeConfig


class BridgeError(CartridgeError):
    """A question the server could not answer: its message goes back to the MCP client as the tool's error."""


async def ask_server(config: BridgeConfig, question: str) -> dict[str, Any]:
    """One routed question to the server: the answer, the cartridges that gave it and their documents' versions."""
    import httpx

    if not question.strip():
        raise BridgeError("The question is empty; ask about the codebase in a sentence.")
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    body = {"model": "auto", "k": config.k, "max_tokens": config.max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": question}]}
    url = config.base_url.rstrip("/") + "/chat/completions"
    try:
        async with httpx.AsyncClient(timeout=config.timeout) as client:
            response = await client.post(url, json=body, headers=headers)
    except httpx.TransportError as err:
        raise BridgeError(f"Cannot reach cartridges serve at {config.base_url} ({type(err).__name__}: {err}); start "
                          "it (`cartridges serve --store DIR`) or pass its address with --base-url.") from err
    if response.status_code != 200:
        try:
            why = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = response.text[:300]
        raise BridgeError(f"cartridges serve answered {response.status_code}: {why}")
    reply = response.json()
    return {"answer": reply["choices"][0]["message"]["content"], "cartridges": reply.get("cartridges", []),
            "versions": reply.get("versions", [])}


def render(reply: dict[str, Any]) -> str:
    """The tool's text: the answer, then where it came from (a document's version is its SHA-256, cut to 12)."""
    versions = reply["versions"] or [None] * len(reply["cartridges"])  # None: a cartridge sync did not make
    sources = ", ".join(f"{name} ({version[:12]})" if version else name
                        for name, version in zip(reply["cartridges"], versions))
    return f"{reply['answer'].strip()}\n\nSources: {sources or 'none'}"


def create_bridge(config: BridgeConfig | None = None) -> Any:
    """The MCP server (`mcp.server.mcpserver.MCPServer`); ``.run()`` serves it over stdio."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    config = config or BridgeConfig()
    server = MCPServer("cartridges", instructions=f"Call {config.tool} to ask about the codebase the cartridges "
                                                  "were built from.")

    async def ask(question: str) -> str:
        try:
            return render(await ask_server(config, question))
        except BridgeError as err:
            raise ToolError(str(err)) from err

    server.add_tool(ask, name=config.tool, description=config.description, structured_output=False)
    return server
