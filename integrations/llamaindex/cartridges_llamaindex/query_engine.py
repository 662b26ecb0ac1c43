"""`CartridgeQueryEngine`: where a LlamaIndex RAG query engine stood, it routes each query to a store's cartridges and
answers with them; the response's source nodes name those cartridges (score, document version, corpus opening)."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from cartridges_sdk.serve import Answerer, Selection

from .llm import in_thread


class CartridgeQueryEngine(BaseQueryEngine):
    """Answers a query with the best `k` cartridges of `store` for it (or as many as fit `budget` tokens), and with
    `passages` tokens of the store's best passages after them (the budget shared; both kinds are source nodes),
    ranked against the query and a first answer of `draft` tokens when given (by `draft_from`'s cartridges when
    given; the response's metadata has it as ``draft``); `trim` cuts cartridges larger than what the passages leave
    of the budget (``"attention"``: to the tokens the question reads most). `streaming=True` returns a
    `StreamingResponse`; `gen` are generation settings (max_tokens, temperature, ...)."""

    def __init__(self, store: Any, *, k: int = 1, budget: int | None = None, passages: int | None = None,
                 retrieval: str | None = None, passages_from: str | None = None, draft: int = 0,
                 draft_from: Any = None, trim: bool | str = False, runtime: Any = "auto", streaming: bool = False,
                 callback_manager: CallbackManager | None = None, **gen: Any):
        self._answerer = Answerer(store=store, k=k, budget=budget, runtime=runtime, passages=passages,
                                  retrieval=retrieval, passages_from=passages_from, draft=draft,
                                  draft_from=draft_from, trim=trim)
        self._streaming = streaming
        self._gen = {"max_new_tokens": gen.pop("max_tokens", 256), **gen}
        self._answerer.request([{"role": "user", "content": "?"}], Selection(()), **self._gen)  # bad settings fail here
        super().__init__(callback_manager)

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {}

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        question = query_bundle.query_str
        chosen = self._answerer.choose(question)
        nodes = [NodeWithScore(node=TextNode(text=c.preview, metadata=c.metadata()), score=c.score) for c in chosen]
        nodes += [NodeWithScore(node=TextNode(text=p.text, metadata={"source": p.name, "passage": True}),
                                score=p.score) for p in chosen.passages]
        turns = [{"role": "user", "content": question}]
        meta = chosen.sources()
        if self._streaming:
            return StreamingResponse(response_gen=self._answerer.stream(turns, chosen, **self._gen),
                                     source_nodes=nodes, metadata=meta)
        text, usage = self._answerer.answer(turns, chosen, **self._gen)
        return Response(response=text, source_nodes=nodes,
                        metadata={**meta, "prompt_tokens": usage.prompt_tokens,
                                  "completion_tokens": usage.completion_tokens})

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        response = await asyncio.to_thread(self._query, query_bundle)
        if isinstance(response, StreamingResponse):  # read in worker threads, as LlamaIndex's async streams are
            return AsyncStreamingResponse(response_gen=in_thread(response.response_gen),
                                          source_nodes=response.source_nodes, metadata=response.metadata)
        return response
