"""Self-study synthesis on vLLM's engine: token-id prompts in, sampled ids with raw top-k log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from cartridges_sdk import Completion, ModelIdentity, SynthesisRequest, Synthesizer, SynthesizerCapabilities
from cartridges_sdk.kit import architecture_of, tokenizer_fingerprint

from . import engine
from .engine import EngineOptions


class VLLMSynthesizer(Synthesizer):
    """The teacher on vLLM: a chunk group's requests go in together, so prefix caching prefills the chunk once;
    log-probs are vLLM's raw ones (before temperature); scoring uses prompt log-probs."""

    Options = EngineOptions
    capabilities = SynthesizerCapabilities(max_top_logprobs=20, score=True, prefix_reuse=True)

    @classmethod
    def capabilities_with(cls, options: Any) -> SynthesizerCapabilities:
        return attrs.evolve(cls.capabilities, max_top_logprobs=options.max_logprobs, max_context=options.max_model_len)

    def __init__(self, model, **options: Any):
        super().__init__(model, **options)
        self.llm = engine.start(model, self.options)

    def identity(self) -> ModelIdentity:
        """Read from the files the engine loaded, not taken from the student: a wrong folder shows up here."""
        from transformers import AutoConfig, AutoTokenizer

        folder = engine.model_folder(self.lm, self.options.model_dir)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return ModelIdentity(name=str(folder), source=str(folder), architecture=architecture_of(config),
                             tokenizer=tokenizer_fingerprint(tokenizer))

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens, seed=r.seed, logprobs=r.top_logprobs or None,
                           stop_token_ids=list(r.stop_ids), detokenize=False)
            for r in requests
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests], params,
                                 use_tqdm=False)
        return [engine.completion(self.lm, out.outputs[0], r.stop_ids, r.top_logprobs) for r, out in zip(requests, outs)]

    def score(self, prefix_ids: Sequence[int], sequences: Sequence[Sequence[int]], top_k: int) -> list[tuple[Any, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prefix_ids) + list(s)) for s in sequences], params,
                                 use_tqdm=False)
        start = len(prefix_ids) + 1  # the positions that predict tokens 1.. of each sequence
        return [engine.topk(list(out.prompt_logprobs[start:]), top_k) for out in outs]

    def close(self) -> None:
        if self.llm is not None:
            engine.stop(self.llm)
            self.llm = None
