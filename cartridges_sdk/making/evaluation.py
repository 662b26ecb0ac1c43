"""Teacher-forced scoring of gold answers: the quality figures of cartridges against ICL and no context.

All methods share one prompt layout: ``[document tokens | cartridge] + chat turn(question) + answer tokens``.
With no context the chat turn starts the sequence. Gap closure is
``(NLL_none - NLL_method) / (NLL_none - NLL_icl)``: 1.0 means as good as the document in context.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ..cartridge import Cartridge
from ..errors import ConfigError
from ..lm import LM


def _answer_ids(lm: LM, answer: str) -> list[int]:
    ids = lm.tokenizer(answer.strip(), add_special_tokens=False)["input_ids"]
    eos = lm.tokenizer.eos_token_id
    return ids + ([eos] if eos is not None else [])


def question_prompt(
    lm: LM, question: str, *, document: str | Sequence[int] | None = None, cartridges: Sequence[Cartridge] | None = None
) -> list[int]:
    """Token ids every method is asked with: the document's tokens (if in context), then the question's chat turn."""
    doc_ids = (lm.encode(document) if isinstance(document, str) else list(document)) if document else []
    return lm.prompt_ids([{"role": "user", "content": question}], prefix_ids=doc_ids, after_cartridge=bool(cartridges))


def answer_logprobs(
    lm: LM, question: str, answer: str, *, document: str | Sequence[int] | None = None,
    cartridges: Sequence[Cartridge] | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[answer tokens, vocab]`` of each gold-answer position, teacher-forced.

    `document` is a text, or token ids as `lm.encode` gives them (e.g. its first p tokens for truncated ICL).
    """
    prompt = question_prompt(lm, question, document=document, cartridges=cartridges)
    ans = _answer_ids(lm, answer)
    logits = lm.logits(prompt + ans, list(cartridges or []))
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(ans)].log_softmax(-1)


def nll(logp: torch.Tensor, lm: LM, answer: str) -> float:
    ids = torch.tensor(_answer_ids(lm, answer), device=logp.device)
    return float(-logp.gather(-1, ids[:, None]).mean())


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean per-token KL(reference || other) from log-probabilities."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


MULTIPLE_CHOICE_INSTRUCTION = "\n\nAnswer with the letter of the correct option only."


def option_token_ids(lm: LM, letters: Sequence[str]) -> list[int]:
    """The token that starts each option letter as an answer; refuses tokenizers that merge two letters' starts."""
    ids = [lm.tokenizer(letter, add_special_tokens=False)["input_ids"][0] for letter in letters]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"Option letters {list(letters)} do not start with distinct tokens in {lm.name!r}.")
    return ids


def choose(
    lm: LM, question: str, letters: Sequence[str], *, document: str | Sequence[int] | None = None,
    cartridges: Sequence[Cartridge] | None = None,
) -> str:
    """The option letter the model ranks first as the first answer token (the question lists the options)."""
    prompt = question_prompt(lm, question + MULTIPLE_CHOICE_INSTRUCTION, document=document, cartridges=cartridges)
    last = lm.logits(prompt, list(cartridges or []))[-1]
    scores = last[torch.tensor(option_token_ids(lm, letters), device=last.device)]
    return letters[int(scores.argmax())]


@attrs.frozen
class QualityReport:
    """Mean gold-answer NLL per token for each method, gap closure, and KL(ICL || cartridge)."""

    nll_none: float
    nll_icl: float
    nll_cartridge: float
    kl_icl_cartridge: float
    questions: int

    @property
    def gap_closure(self) -> float:
        gap = self.nll_none - self.nll_icl
        return (self.nll_none - self.nll_cartridge) / gap if gap else float("nan")


def score(
    lm: LM, document: str, cartridges: Sequence[Cartridge], qa: Sequence[tuple[str, str]]
) -> list[QualityReport]:
    """Score each cartridge against the whole `document` in context and against no context on question/answer pairs.

    The no-context and in-context passes (the expensive one) run once per question, shared by all cartridges.
    """
    none, icl = [], []
    carts: list[list[float]] = [[] for _ in cartridges]
    kls: list[list[float]] = [[] for _ in cartridges]
    for q, a in qa:
        lp_icl = answer_logprobs(lm, q, a, document=document)
        none.append(nll(answer_logprobs(lm, q, a), lm, a))
        icl.append(nll(lp_icl, lm, a))
        for i, cartridge in enumerate(cartridges):
            lp_cart = answer_logprobs(lm, q, a, cartridges=[cartridge])
            carts[i].append(nll(lp_cart, lm, a))
            kls[i].append(kl(lp_icl, lp_cart))
    mean = lambda xs: sum(xs) / len(xs)
    return [QualityReport(mean(none), mean(icl), mean(c), mean(k), len(qa)) for c, k in zip(carts, kls)]
