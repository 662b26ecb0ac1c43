"""How good is this cartridge for its own corpus? A check that needs no gold answers.

The model, with a stretch of the corpus in context, asks itself questions about it (self-study's question seed
prompts, sampled from a seed stream of the report's own, so no question is ever a training one) and answers each
greedily. Those in-context answers are the reference. Teacher-forced on them, three readers are scored: no context,
the text in context, and the cartridge. The report says

- ``recovered``: the share of the in-context answers' likelihood gain over no context that the cartridge recovers
  (1.0: as good as the text in context; 0: no better than nothing), the no-gold analogue of gap closure;
- ``kl``: mean per-token KL(text in context || cartridge) on the answers' tokens;
- ``agreement``: how often the cartridge's greedy next token is the one the text in context picks, on those tokens.

The text in context is an exact prefix cartridge of it (`Cartridge.from_prefix`: the same next-token distribution
as the text in a prompt), read once per stretch and shared by the questions, their answers and the scoring. A corpus
longer than `ReportConfig.window_tokens` is read in a few stretches spread over it, each the corpus's first token
then a contiguous window. How well ``recovered`` tracks gold-answer closure is measured in docs/quality-report.md.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tqdm.auto import tqdm

from ..cartridge import Cartridge
from ..errors import ConfigError
from ..identity import text_fingerprint, token_fingerprint
from ..hf import HFRuntime
from ..lm import LM
from . import seeds
from .corpus import Corpus
from .evaluation import answer_logprobs, kl, nll
from .precision import resolve_work_dtype
from .settings import ReportConfig

KEY = "quality"  # where the report sits in a cartridge's metadata (``meta.extra``)
QUESTION_TEMPERATURE = 0.8  # sampled, so that three seed prompts give more than three questions
QUESTION_TOKENS = 40  # a question is at most this long
# nats a token the text in context must add for `recovered` to be read: the embedded 135M adds 0.02-0.07 on its own
# questions about the sample text (it asks and answers without reading it), the 0.5B 3.1
INFORMATIVE_GAIN = 0.25
SHOWN_QUESTIONS = 3  # questions kept in the report, so a reader sees what was asked


@attrs.frozen
class CorpusReport:
    """The cartridge scored against its corpus in context, on questions the model asked about that corpus."""

    recovered: float  # NaN when the text in context did not help on these questions (nothing to recover)
    kl: float
    agreement: float
    questions: int
    nll: dict[str, float]  # mean per-token NLL of the in-context answers: none, context, cartridge
    windows: int  # stretches of the corpus the questions were asked about
    window_tokens: int  # the longest of them
    seconds: float
    seed: int
    dtype: str = "float32"  # what it was computed in
    asked: tuple[str, ...] = attrs.field(converter=tuple, default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (what the file's metadata keeps): NaN becomes None, the questions a list."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else list(v) if isinstance(v, tuple) else v)
                for k, v in attrs.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CorpusReport:
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: (math.nan if v is None and k in ("recovered", "kl", "agreement") else v)
                      for k, v in data.items() if k in known})

    def summary(self) -> str:
        """One line a user reads after a build."""
        if self.questions == 0:
            return "quality report: the model asked no usable question about the corpus; nothing was scored"
        got = ("the text in context did not help on these questions, so there was nothing to recover"
               if math.isnan(self.recovered) else f"recovers {self.recovered:.2f} of what the text in context adds")
        line = (f"quality report: {got} (KL {self.kl:.2f}, greedy agreement {self.agreement:.2f}; "
                f"{self.questions} held-out questions the model asked itself, {self.seconds:.0f} s)")
        if not self.informative:
            line += (f". Not informative: the text in context moves this model's answers to its own questions by "
                     f"{self.gain:.2f} nats a token (under {INFORMATIVE_GAIN}); a reader that reads the text closely "
                     "(e.g. qwen2.5-coder-0.5b) gives a report that means something")
        return line

    @property
    def gain(self) -> float:
        """What the text in context adds: the in-context answers' NLL per token without it, less with it."""
        return self.nll["none"] - self.nll["context"] if self.questions else math.nan

    @property
    def informative(self) -> bool:
        """Whether the text in context changes the answers enough for `recovered` to mean something."""
        return self.questions > 0 and self.gain >= INFORMATIVE_GAIN


def report_of(cartridge: Cartridge) -> CorpusReport | None:
    """The report stored in a cartridge's metadata, or None."""
    data = cartridge.meta.extra.get(KEY)
    return CorpusReport.from_dict(data) if isinstance(data, dict) else None


def with_report(cartridge: Cartridge, report: CorpusReport) -> Cartridge:
    """`cartridge` carrying `report` in its metadata (``meta.extra["quality"]``)."""
    meta = attrs.evolve(cartridge.meta, extra={**cartridge.meta.extra, KEY: report.to_dict()})
    return Cartridge(cartridge.keys, cartridge.values, meta, lm=cartridge.lm)


def check_report(report: Any) -> bool:
    """Whether a report is asked for; a `report=` that is neither a bool nor a `ReportConfig` is refused."""
    if report is not True and report is not False and not isinstance(report, ReportConfig):
        raise ConfigError(f"report={report!r:.60} must be True, False (skip the quality report) or a ReportConfig.")
    return report is not False


def reported(lm: LM, corpus: Any, cartridge: Cartridge, report: bool | ReportConfig, *,
             progress: bool = False) -> Cartridge:
    """What `Cartridge.compact`, `from_corpus` and sync return: `cartridge` with its report (`report` True or a
    `ReportConfig`; False skips it), printed when `progress` is on."""
    if not check_report(report):
        return cartridge
    found = check_quality(lm, corpus, cartridge, None if report is True else report, progress=progress)
    if progress:
        print(found.summary(), file=sys.stderr, flush=True)
    return with_report(cartridge, found)


def corpus_ids(lm: LM, corpus: Any) -> tuple[list[int], str | None]:
    """Token ids of a text, a path, a `Corpus` or token ids, as compaction reads them, and the text (None for ids)."""
    if torch.is_tensor(corpus) or (isinstance(corpus, (list, tuple)) and corpus and not isinstance(corpus[0], str)):
        return lm.check_ids(corpus, "the corpus"), None
    text = Corpus.coerce(corpus).text
    return lm.encode(text), text


def check_quality(lm: LM, corpus: Any, cartridge: Cartridge, config: ReportConfig | None = None, *,
                  progress: bool = False) -> CorpusReport:
    """Score `cartridge` against `corpus` in context on held-out questions the model asks itself (module docstring).

    `corpus` is what the cartridge was made from: a text, a path, a `Corpus` or token ids. A cartridge made from
    another corpus is refused (its ``meta.corpus`` fingerprint says which)."""
    config = config or ReportConfig()
    if not isinstance(config, ReportConfig):
        raise ConfigError(f"config={config!r:.60} must be a ReportConfig.")
    started = time.perf_counter()
    ids = _same_corpus(lm, corpus, cartridge)
    # an estimate, not a contract: by default computed in the dtype self-study's synthesis stage measures fastest
    # here (bfloat16 halves the 0.5B's report), both references alike
    lm = lm.in_dtype(resolve_work_dtype(lm, config.dtype, stages=("synthesis",))["synthesis"])
    cartridge = cartridge.bind(lm)
    windows = _windows(lm, ids, config)
    per_window = math.ceil(config.questions / len(windows))
    none, context, cart, kls, agree, asked = [], [], [], [], [], []
    bar = tqdm(total=config.questions, desc="quality report", unit="q", disable=not progress, leave=False)
    # a runtime of its own, closed at the end: the model's shared one would keep every window it was given installed
    runtime = HFRuntime(lm, max_installed=1)
    try:
        for w, window in enumerate(windows):
            text = Cartridge.from_prefix(lm, window, len(window), num_frozen=1)  # the window in context, exactly
            count = min(per_window, config.questions - w * per_window)
            for question, answer in _questions_and_answers(runtime, text, count, config, config.seed + w):
                lp_text = answer_logprobs(lm, question, answer, cartridges=[text])
                lp_cart = answer_logprobs(lm, question, answer, cartridges=[cartridge])
                context.append(nll(lp_text, lm, answer))
                cart.append(nll(lp_cart, lm, answer))
                none.append(nll(answer_logprobs(lm, question, answer), lm, answer))
                kls.append(kl(lp_text, lp_cart))
                agree.append(float((lp_text.argmax(-1) == lp_cart.argmax(-1)).float().mean()))
                asked.append(question)
                bar.update()
    finally:
        bar.close()
        runtime.close()
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    gain = mean(none) - mean(context)
    recovered = (mean(none) - mean(cart)) / gain if gain > 0 else math.nan
    return CorpusReport(recovered=recovered, kl=mean(kls), agreement=mean(agree), questions=len(asked),
                        nll={"none": mean(none), "context": mean(context), "cartridge": mean(cart)},
                        windows=len(windows), window_tokens=max(len(w) for w in windows),
                        seconds=round(time.perf_counter() - started, 1), seed=config.seed,
                        dtype=str(lm.dtype).removeprefix("torch."),
                        asked=[" ".join(q.split()) for q in asked[:SHOWN_QUESTIONS]])


def _same_corpus(lm: LM, corpus: Any, cartridge: Cartridge) -> list[int]:
    """The corpus's token ids as the cartridge was made from them, refusing another corpus. Compaction records its
    tokens' fingerprint, self-study its text's; a `Corpus` of files heads each with its name where `from_prefix` and
    sync read a text as it is, so a single text or file is also tried as it is."""
    ids, text = corpus_ids(lm, corpus)
    made = (cartridge.meta.corpus or {}).get("fingerprint")
    if made is None or made in (token_fingerprint(ids), text is not None and text_fingerprint(text)):
        return ids
    as_is = [corpus] if isinstance(corpus, str) and text != corpus else []
    if text is not None and len(documents := Corpus.coerce(corpus).documents) == 1:
        as_is += [documents[0].text, documents[0].text.strip()]
    for raw in as_is:
        if made in (token_fingerprint(raw_ids := lm.encode(raw)), text_fingerprint(raw)):
            return raw_ids
    raise ConfigError(
        f"The cartridge was made from another corpus (fingerprint {made}, {cartridge.meta.corpus.get('num_tokens')} "
        f"tokens) than the one given ({len(ids)} tokens); give the corpus it was made from, as it was then."
    )


def _windows(lm: LM, ids: list[int], config: ReportConfig) -> list[list[int]]:
    """The stretches questions are asked about: the whole corpus when it fits, else a few spread over it."""
    turn = lambda text: len(lm.prompt_ids([{"role": "user", "content": text}], after_cartridge=True))  # noqa: E731
    # after the window: a seed prompt and the question it draws, or a question (re-read, a few tokens of slack) and
    # its answer
    room = max(max(map(turn, seeds.QUESTION_PROMPTS)) + QUESTION_TOKENS,
               turn("") + QUESTION_TOKENS + 8 + config.answer_tokens)
    limit = min(config.window_tokens, (lm.max_context or len(ids) + room) - room)
    if limit < 16:
        raise ConfigError(f"The quality report's questions and answers ({room} tokens) leave {limit} tokens of "
                          f"{lm.name!r}'s context of {lm.max_context} for the corpus; lower answer_tokens, raise "
                          "window_tokens, or skip the report (report=False, --no-report).")
    if len(ids) <= limit:
        return [list(ids)]
    count = min(config.windows, math.ceil(len(ids) / limit))
    last = len(ids) - (limit - 1)  # the last start (after the first token, kept as the attention sink)
    starts = [1 + (last - 1) * i // (count - 1) for i in range(count)] if count > 1 else [1 + (last - 1) // 2]
    return [ids[:1] + ids[s : s + limit - 1] for s in starts]


def _questions_and_answers(runtime: HFRuntime, text: Cartridge, count: int, config: ReportConfig,
                           seed: int) -> list[tuple[str, str]]:
    """`count` questions the model asks with `text` in context, each with its greedy in-context answer; empty and
    repeated questions, and questions left unanswered, are dropped."""
    if count <= 0:
        return []
    prompts = [seeds.QUESTION_PROMPTS[i % len(seeds.QUESTION_PROMPTS)] for i in range(count)]
    lm = runtime.lm
    drawn = lm.ask(prompts, [text], runtime=runtime, max_new_tokens=QUESTION_TOKENS, temperature=QUESTION_TEMPERATURE,
                   seed=seed)
    questions = list(dict.fromkeys(q.strip() for q in drawn if q.strip()))
    if not questions:
        return []
    answers = lm.ask(questions, [text], runtime=runtime, max_new_tokens=config.answer_tokens)
    return [(q, a.strip()) for q, a in zip(questions, answers) if a.strip()]
