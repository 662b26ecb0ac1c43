"""L-Eval-format long-document benchmarks: one JSON object per line with the document (`input`), its questions
(`instructions`, multiple-choice options inline) and gold answers (`outputs`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from cartridges_sdk.errors import ConfigError

EVALDATA = Path(__file__).resolve().parent.parent.parent / "shared" / "evaldata"
DEFAULT_DATA = EVALDATA / "scientific_qa_dev.jsonl"

_OPTION = re.compile(r"^\s*\(?([A-Z])[).]\s+\S", re.MULTILINE)
_GOLD_LETTER = re.compile(r"^\s*\(?([A-Z])(?:[).]|$|\s)")


@attrs.frozen
class Question:
    question: str
    answer: str
    options: tuple[str, ...] = ()  # option letters when the question is multiple choice
    gold: str | None = None  # the gold option letter

    @property
    def multiple_choice(self) -> bool:
        return bool(self.options) and self.gold in self.options


@attrs.frozen
class Corpus:
    """What one cartridge is trained on and asked about: one document, or several concatenated (`--concat`)."""

    name: str
    text: str
    questions: tuple[Question, ...]
    doc_indices: tuple[int, ...]

    @property
    def multiple_choice(self) -> bool:
        return bool(self.questions) and all(q.multiple_choice for q in self.questions)


def parse_question(question: str, answer: str) -> Question:
    """A question with its option letters and gold letter, when its text lists options (A), (B) ... or A. B. ..."""
    letters = tuple(dict.fromkeys(_OPTION.findall(question)))
    gold = _GOLD_LETTER.match(answer)
    if len(letters) >= 2 and letters == tuple(chr(ord("A") + i) for i in range(len(letters))) and gold:
        return Question(question, answer, letters, gold.group(1))
    return Question(question, answer)


def _parse_indices(spec: str | Sequence[int] | None, available: int, path: Path) -> list[int]:
    if spec is None:
        return [0]
    if isinstance(spec, str):
        try:
            indices = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--docs {spec!r} must be comma-separated line numbers, e.g. --docs 0,3.") from None
    else:
        indices = list(spec)
    bad = [i for i in indices if not 0 <= i < available]
    if not indices or bad:
        raise ConfigError(f"--docs {spec!r}: {path} has documents 0..{available - 1}; {bad or 'none'} given.")
    return indices


def load_corpora(path: str | Path, docs: str | Sequence[int] | None = None, *, concat: bool = False) -> list[Corpus]:
    """The corpora a run benchmarks: each chosen line on its own, or all of them joined into one corpus."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--data {str(path)!r} does not exist; give an L-Eval-format JSONL file.")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n + 1} is not JSON ({e.msg}); each line must be one JSON object.") from None
        missing = [k for k in ("input", "instructions", "outputs") if k not in row]
        if missing:
            raise ConfigError(f"{path}:{n + 1} lacks {missing}; each line needs input, instructions and outputs.")
        if len(row["instructions"]) != len(row["outputs"]) or not row["instructions"]:
            raise ConfigError(
                f"{path}:{n + 1} has {len(row['instructions'])} instructions and {len(row['outputs'])} outputs; "
                "each question needs exactly one gold answer."
            )
        if not str(row["input"]).strip():
            raise ConfigError(f"{path}:{n + 1} has an empty document (input).")
        rows.append(row)
    indices = _parse_indices(docs, len(rows), path)
    singles = [
        Corpus(
            name=f"{path.stem}-{i}",
            text=rows[i]["input"],
            questions=tuple(parse_question(q, a) for q, a in zip(rows[i]["instructions"], rows[i]["outputs"])),
            doc_indices=(i,),
        )
        for i in indices
    ]
    if not concat or len(singles) == 1:
        return singles
    return [
        Corpus(
            name=f"{path.stem}-{'+'.join(str(i) for i in indices)}",
            text="\n\n".join(c.text for c in singles),
            questions=tuple(q for c in singles for q in c.questions),
            doc_indices=tuple(indices),
        )
    ]


_WORD = re.compile(r"[a-z0-9]{3,}")
_COMMON = frozenset("the and for are was were with that this what which who how why when where does did do they their "
                    "them from into over used use using about than then have has had been its not all any can".split())


def only_own_words(question: str, own: str, others: Sequence[str]) -> list[str]:
    """The question's words (3+ letters, not function words) found in `own` and in none of `others`: what lets a
    router that reads only the question place it. Independent of the store's tokenizer, so tests can check it."""
    def words(text: str) -> set[str]:
        return set(_WORD.findall(text.lower())) - _COMMON

    elsewhere = set().union(*map(words, others)) if others else set()
    return sorted((words(question) & words(own)) - elsewhere)
