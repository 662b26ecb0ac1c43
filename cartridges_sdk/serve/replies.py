"""What the server sends back, in OpenAI's shapes: an error body, a whole answer, or a stream of server-sent events;
and how a job's outcome becomes one of them. Messages never show where the server keeps its files (`scrubber`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse  # imported only to serve; the core never imports it

from ..errors import ConfigError, IncompatibleCartridgeError
from ..generation import Completion
from .engine import Job
from .guard import BadRequest

# what the runtime's own checks refuse: the request's fault, answered 400 (a stream's error event says so too)
REFUSALS = (ConfigError, IncompatibleCartridgeError)
# OpenAI's error type for each status; other 4xx are invalid_request_error, 5xx server_error
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def scrubber(root: Path) -> Callable[[str], str]:
    """A function that replaces the store's absolute path in a message with its folder name: clients are told names,
    never where the server keeps its files."""
    paths = sorted({p for p in (str(root.absolute()), str(root.resolve())) if len(p) > 1}, key=len, reverse=True)

    def scrub(message: str) -> str:
        for path in paths:
            message = message.replace(path, root.name or "store")
        return message

    return scrub


def error_response(refused: BadRequest, scrub: Callable[[str], str]) -> JSONResponse:
    """The refusal as OpenAI's error body, with its status and headers (retry-after)."""
    status = refused.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": scrub(refused.message), "type": kind, "param": refused.param,
                                   "code": status}}, status_code=status, headers=refused.headers)


def usage_of(usage: dict[str, int], completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage block, with the cartridges' tokens beside the prompt's."""
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": completion_tokens,
            "total_tokens": usage["prompt_tokens"] + completion_tokens, "cartridge_tokens": usage["cartridge_tokens"]}


def completion_body(rid: str, model: str, out: Completion, sources: dict[str, list], usage: dict[str, int]) -> dict:
    """A whole answer as a chat.completion, with the cartridges that gave it and their versions (`sources`)."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": out.finish_reason}],
            "usage": usage_of(usage, len(out.token_ids)), **sources}


async def answer(job: Job, request: Any) -> Completion:
    """The job's whole answer, or the BadRequest that says why not: 400 for what the runtime's checks refuse, 499
    for a client that went away, 500 for a runtime that failed."""
    try:
        return await _wait(job, request)
    except BadRequest:
        raise
    except REFUSALS as err:
        raise BadRequest(400, str(err)) from err
    except Exception as err:
        raise BadRequest(500, f"The runtime failed: {type(err).__name__}: {err}") from err


async def _wait(job: Job, request: Any) -> Completion:
    """The job's answer; a client that disconnects meanwhile cancels it (it is not run, or its answer dropped)."""
    try:
        while True:
            done, _ = await asyncio.wait({job.out}, timeout=0.5)
            if done:
                return job.out.result()
            if await request.is_disconnected():
                job.cancelled.set()
                raise BadRequest(499, "The client disconnected.")
    finally:
        if not job.out.done():
            job.cancelled.set()


# how often a running stream checks that its key still opens what answers it (revoked, rotated, narrowed)
CHECK_SECONDS = 0.25


async def stream_events(job: Job, rid: str, model: str, sources: dict[str, list], usage: dict[str, int],
                        include_usage: bool, scrub: Callable[[str], str], record: dict[str, Any],
                        withdrawn: Callable[[], tuple[str, BadRequest] | None] | None = None) -> AsyncIterator[str]:
    """Server-sent events in the OpenAI chunk format, then usage (if asked for, as OpenAI does: a last chunk with no
    choices); a client that goes away cancels its decoding. Every `CHECK_SECONDS`, tokens or not, `withdrawn` says
    whether the key may still read the answer: when it may not, an error event ends the stream."""
    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": choices, **sources, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def error(message: str, kind: str) -> str:
        return f"data: {json.dumps({'error': {'message': scrub(message), 'type': kind}})}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        checked = time.monotonic()
        while True:
            try:
                piece = await asyncio.wait_for(job.out.get(), CHECK_SECONDS)
            except TimeoutError:
                piece = ""
            if withdrawn is not None and time.monotonic() - checked >= CHECK_SECONDS:
                checked = time.monotonic()
                stopped = withdrawn()
                if stopped is not None:
                    job.cancelled.set()
                    record["error"] = stopped[0]  # the stream began with 200: the log says how it ended
                    yield error(stopped[1].message, ERROR_TYPES.get(stopped[1].status, "server_error"))
                    yield "data: [DONE]\n\n"
                    return
            if not isinstance(piece, str):
                break
            if piece:
                yield chunk({"content": piece})
        if isinstance(piece, BaseException):
            kind = "invalid_request_error" if isinstance(piece, REFUSALS) else "server_error"
            record["error"] = kind
            yield error(str(piece), kind)
            yield "data: [DONE]\n\n"  # the stream is over: clients waiting for the end marker stop here
            return
        if piece is None:  # cut short (the server is stopping)
            return
        yield chunk({}, piece.finish_reason)
        if include_usage:
            yield chunk(None, usage=usage_of(usage, len(piece.token_ids)))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # finished, or the client disconnected: either way, no more work for it
