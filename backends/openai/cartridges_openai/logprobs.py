"""Reading token ids and top-k log-probabilities out of a completions response, in the student's tokenizer.

Two shapes of ``choices[i].logprobs`` are read:

- the completions API's own: ``tokens`` and ``top_logprobs`` (one ``{token: logprob}`` dict per position). vLLM
  writes each token as ``"token_id:N"`` when asked (``return_tokens_as_token_ids``); other servers write its text.
- a ``content`` list of ``{"id", "token", "logprob", "top_logprobs": [...]}`` entries (llama.cpp's server), where
  ``id`` is the token id.

Text is mapped back to ids only where the mapping is certain: each token's text must be the text of exactly one
token of the student's tokenizer, and the tokens must add up to the server's text. Otherwise the server cannot be
used for distillation, and the error says what it lacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

import numpy as np

from cartridges_sdk import BackendError

ID_PREFIX = "token_id:"
STRINGS_ONLY = (
    "it returns tokens as text, not ids (distillation needs the teacher's top-k as ids of the student's tokenizer); "
    "use a server that returns ids: vLLM (return_tokens_as_token_ids, which this backend asks for) or llama.cpp's "
    "server (ids in its log-probs)"
)


class TokenReader:
    """Token ids from what a server wrote: ``token_id:N``, a plain id, or text mapped back through the tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._by_text: dict[str, int] | None = None
        self._texts: Counter | None = None

    def _build(self) -> None:
        texts = [self.tokenizer.decode([i]) for i in range(len(self.tokenizer))]
        self._texts = Counter(texts)
        self._by_text = {t: i for i, t in enumerate(texts) if self._texts[t] == 1 and "\ufffd" not in t}

    def id(self, server: str, token: Any, token_id: Any = None) -> int:
        if token_id is not None:
            return int(token_id)
        if isinstance(token, int):
            return token
        if not isinstance(token, str):
            raise BackendError(f"{server} returned a token {token!r} that is neither text nor an id.")
        if token.startswith(ID_PREFIX):
            return int(token[len(ID_PREFIX):])
        if self._by_text is None:
            self._build()
        found = self._by_text.get(token)
        if found is None:
            n = self._texts.get(token, 0)
            why = (f"is the text of {n} tokens" if n > 1 else "is part of a character" if "\ufffd" in token
                   else "is the text of no single token")
            raise BackendError(
                f"{server} cannot be used for self-study: {STRINGS_ONLY}. Its token {token!r} {why} of the "
                "student's tokenizer, so its id cannot be verified."
            )
        return found


def positions(choice: dict[str, Any], reader: TokenReader, server: str, stops: Collection[int] = ()
              ) -> tuple[list[int], list[list[tuple[int, float]] | None]]:
    """The choice's token ids and, per position, its ``(id, logprob)`` candidates (None where the server gave none).

    `stops`: the ids that end a completion; a server leaves the one it stopped on out of its text."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise BackendError(f"{server} returned no log-probabilities; it must honour the completions API's "
                           "`logprobs` parameter.")
    try:
        if isinstance(lp.get("content"), list):  # llama.cpp's server: entries with ids
            ids, cands = [], []
            for entry in lp["content"]:
                ids.append(reader.id(server, entry.get("token"), entry.get("id")))
                cands.append([(reader.id(server, c.get("token"), c.get("id")), float(c["logprob"]))
                              for c in entry.get("top_logprobs") or []])
            return ids, cands
        tokens, tops = lp.get("tokens"), lp.get("top_logprobs")
        if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) != len(tops):
            raise BackendError(f"{server} returned log-probabilities without matching `tokens` and `top_logprobs`.")
        ids = [reader.id(server, t) for t in tokens]
        cands = [None if top is None else [(reader.id(server, t), float(v)) for t, v in top.items()] for top in tops]
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise BackendError(f"{server} returned log-probabilities this backend cannot read ({type(err).__name__}: "
                           f"{err}); it must follow the completions API's `logprobs` format.") from err
    as_text = any(not (isinstance(t, str) and t.startswith(ID_PREFIX)) for t in tokens)
    if as_text and not _adds_up(tokens, ids, choice, reader, stops):
        raise BackendError(f"{server} cannot be used for self-study: {STRINGS_ONLY}. Its tokens do not add up "
                           "to its text, so the ids cannot be verified.")
    return ids, cands


def _adds_up(tokens: list[str], ids: list[int], choice: dict[str, Any], reader: TokenReader,
             stops: Collection[int]) -> bool:
    """Whether the tokens spell the server's text, allowing for what servers leave out of it: special tokens, and
    the stop token a completion ended on."""
    text = choice.get("text")
    if text is None or "".join(tokens) == text:
        return True
    special = set(getattr(reader.tokenizer, "all_special_ids", ()))
    kept = [t for t, i in zip(tokens, ids) if i not in special]
    if choice.get("finish_reason") == "stop" and ids and ids[-1] in stops and ids[-1] not in special:
        kept = kept[:-1]
    return "".join(kept) == text


def topk(cands: list[list[tuple[int, float]] | None], k: int, server: str) -> tuple[np.ndarray, np.ndarray]:
    """Per position the k most likely ``(id, logprob)`` as ``[positions, k]`` arrays. Servers add the chosen token
    to its position's candidates wherever it ranks, so the k best are taken by log-prob."""
    ids = np.zeros((len(cands), k), dtype=np.int64)
    lps = np.zeros((len(cands), k), dtype=np.float32)
    for row, entries in enumerate(cands):
        best = sorted(dict(entries or ()).items(), key=lambda e: -e[1])[:k]  # one entry per id, ties in order
        if len(best) != k:
            raise BackendError(
                f"{server} returned {len(best)} of the {k} top log-probabilities asked for at a position; start it "
                f"with a large enough limit (vLLM: --max-logprobs {max(k, 20)})."
            )
        ids[row] = [i for i, _ in best]
        lps[row] = [v for _, v in best]
    return ids, lps
