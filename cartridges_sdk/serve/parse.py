"""What a chat completion request may say, checked field by field before it reaches the engine: each refusal is a
`BadRequest` (4xx) naming the field and the fix."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError
from ..generation import GenerationParams
from .guard import BadRequest
from .passages import PASSAGES_FROM, RETRIEVALS, TRIMS
from .settings import ServeConfig

ROLES = ("system", "user", "assistant")
# this server's own fields, beside OpenAI's: how many cartridges are routed to, and the passages put after them
ROUTING = {"k", "budget", "passages", "retrieval", "passages_from", "draft", "trim"}
MAX_PASSAGE_TOKENS = 8192
MAX_DRAFT_TOKENS = 256  # a first answer's tokens: each is decoded before the answer starts
# request fields this server reads; others are refused by name (an ignored setting would answer something else)
FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
          "stream_options", "n", "user", "cartridges", "presence_penalty", "frequency_penalty"}


async def read_json(request: Any, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"The request body is {declared} bytes; the limit is {limit}.")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise BadRequest(413, f"The request body is over the limit of {limit} bytes.")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad UTF-8 or syntax, a number too long to read, nesting too deep
        why = ("it is nested too deeply" if isinstance(err, RecursionError) else
               "a number in it has too many digits" if "integer string conversion" in str(err) else str(err))
        raise BadRequest(400, f"The request body is not valid JSON: {why}.") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "The request body must be a JSON object.")
    try:  # JSON may escape half of a UTF-16 pair ("\ud800"): valid JSON, but no text a tokenizer can read
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(400, "The request body is not valid text: it escapes a lone UTF-16 surrogate (such as "
                         "\\ud800); send the character itself or its whole surrogate pair.") from None
    return body


def _message(i: int, m: Any) -> dict[str, str]:
    """A message as the chat template takes it: its role and its text. Content may come as OpenAI's list of text
    parts (IDE clients such as Continue send that), joined by newlines; other parts (images) are refused."""
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, list) and content:
        kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
        if kinds != {"text"} or not all(isinstance(p.get("text"), str) for p in content):
            raise BadRequest(400, f"messages[{i}].content has parts of type {sorted(map(str, kinds))}; this server "
                             "reads text only ({'type': 'text', 'text': ...}).", f"messages[{i}]")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str) or m.get("role") not in ROLES:
        raise BadRequest(400, f"messages[{i}] must be {{'role': one of {list(ROLES)}, 'content': a string or a list "
                         "of text parts}.", f"messages[{i}]")
    return {"role": m["role"], "content": content}


def parse_request(body: dict[str, Any], config: ServeConfig):
    """(cartridge names, or None for routing; messages; generation params; stream; whether a stream ends with usage),
    or BadRequest naming the field. Fields are checked in a fixed order, so a request with several faults is told
    of the same one every time."""
    unknown = sorted(set(body) - FIELDS - ROUTING)
    if unknown:
        raise BadRequest(400, f"Unsupported parameter(s) {unknown}; this server reads {sorted(FIELDS)}.", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "'model' must name a cartridge (GET /v1/models lists them), 'auto', or the bare model.",
                         "model")
    messages = _messages(body)
    _check_unsupported(body)
    stream, include_usage = _streaming(body)
    max_tokens, stop = _length(body, config)
    _check_routing_sizes(body)
    _check_passages(body)
    try:
        params = GenerationParams(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 0.0),
                                  top_p=_number(body, "top_p", 1.0), seed=body.get("seed"), stop=stop)
    except (ConfigError, TypeError) as err:  # the settings' validators name the field first: "seed=... must be"
        field = str(err).split("=", 1)[0]
        raise BadRequest(400, str(err), field if field.isidentifier() else None) from None
    return _names(body, model), messages, params, stream, include_usage


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list of {role, content}.", "messages")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    if not any(m["role"] == "user" for m in messages):
        raise BadRequest(400, "'messages' needs at least one user turn.", "messages")
    return messages


def _check_unsupported(body: dict[str, Any]) -> None:
    """`user` as the audit log takes it; `n` and the penalties only at the value every answer has here."""
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise BadRequest(400, "'user' must be a string of at most 256 characters (it names the end user in the "
                         "audit log).", "user")
    if body.get("n", 1) != 1:
        raise BadRequest(400, "Only n=1 is supported.", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, 0) not in (0, 0.0, None):
            raise BadRequest(400, f"{name} is not supported (only 0).", name)


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether to stream, and whether the stream ends with usage."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be true or false.", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest(400, "'stream_options' goes with 'stream': true only.", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(400, "'stream_options' must be {\"include_usage\": true or false}.", "stream_options")
    return stream, bool((options or {}).get("include_usage", False))


def _length(body: dict[str, Any], config: ServeConfig) -> tuple[int, Any]:
    """max_tokens (the server's default when not given, within its limit) and the stop strings."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= config.max_new_tokens:
        raise BadRequest(400, f"'max_tokens' must be an int from 1 to {config.max_new_tokens}.", "max_tokens")
    stop = body.get("stop") or ()
    if isinstance(stop, list) and len(stop) > 4:  # each is looked for after every token, in the whole batch's step
        raise BadRequest(400, f"'stop' has {len(stop)} strings; at most 4 are read (as OpenAI does).", "stop")
    return max_tokens, stop


def _check_routing_sizes(body: dict[str, Any]) -> None:
    k = body.get("k", 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 8:
        raise BadRequest(400, "'k' (cartridges routed to, with model='auto') must be an int from 1 to 8.", "k")
    budget = body.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise BadRequest(400, "'budget' (cartridge tokens routed to, with model='auto') must be a positive int.",
                         "budget")


def _check_passages(body: dict[str, Any]) -> None:
    passages = body.get("passages")
    if passages is not None and (isinstance(passages, bool) or not isinstance(passages, int)
                                 or not 0 <= passages <= MAX_PASSAGE_TOKENS):
        raise BadRequest(400, f"'passages' (prompt tokens of the store's passages after the cartridges) must be an int "
                         f"from 0 to {MAX_PASSAGE_TOKENS}.", "passages")
    draft = body.get("draft")
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, int)
                              or not 0 <= draft <= MAX_DRAFT_TOKENS):
        raise BadRequest(400, f"'draft' (tokens of a first answer the passages are ranked against) must be an int "
                         f"from 0 to {MAX_DRAFT_TOKENS}.", "draft")
    for field, allowed in (("retrieval", RETRIEVALS), ("passages_from", PASSAGES_FROM)):
        # where no passages are looked for, `server.resolve` refuses it: that turns on the model (`passages.sought`)
        if field in body and body[field] not in allowed:
            raise BadRequest(400, f"'{field}' must be one of {list(allowed)}.", field)
    budget = body.get("budget")
    if passages and budget is not None and passages >= budget:
        raise BadRequest(400, f"'passages' ({passages}) leaves nothing of 'budget' ({budget}) for cartridges; send "
                         "fewer passage tokens or a larger budget ('budget' counts cartridges and passages).", "passages")
    trim = body.get("trim")
    if trim is not None and not isinstance(trim, bool) and trim not in TRIMS:
        raise BadRequest(400, "'trim' (cut routed cartridges larger than what 'passages' leave of 'budget') must be "
                         f"true or false, or one of {list(TRIMS)} (keep their first tokens, or those the question "
                         "reads most).", "trim")
    if trim and (budget is None or not passages):
        raise BadRequest(400, "'trim' cuts the routed cartridges to what 'passages' leave of 'budget'; send both "
                         "(with model 'auto'), or drop 'trim'.", "trim")


def _names(body: dict[str, Any], model: str) -> list[str] | None:
    """The cartridges asked for, composed in order; None: routed (model='auto'), with k or budget."""
    listed = body.get("cartridges")
    if listed is not None:
        if not isinstance(listed, list) or not listed or not all(isinstance(n, str) for n in listed):
            raise BadRequest(400, "'cartridges' must be a non-empty list of cartridge names, composed in order.",
                             "cartridges")
        names: list[str] | None = list(listed)
    elif model == "auto":
        names = None
    else:
        names = [model]
    routing = [field for field in ("k", "budget") if field in body]
    if len(routing) == 2:
        raise BadRequest(400, "'k' and 'budget' both say how many cartridges are routed to; send one of them.", "k")
    if routing and names is not None:  # a silently ignored field would answer from other cartridges than asked for
        raise BadRequest(400, f"'{routing[0]}' picks routed cartridges, so it goes with model='auto' and no "
                              "'cartridges'; drop it, or route.", routing[0])
    return names


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(400, f"'{name}' must be a number.", name)
    return float(value)
