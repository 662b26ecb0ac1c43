"""Who or what a cartridge is about (its subject: a patient, a module, a filing), and which subjects a question names.

Under ``model="auto"`` the server routes a question that names a subject only to the cartridges about that subject
(among those the key opens), and refuses one that names someone it cannot match, so that a question about one
patient is never answered from another's record (docs/security.md, "Subjects").

A question names a subject when it holds the subject's name as a clinic writes it: in any case, given name first or
family name first (``Quill, Ada``), with initials for given names (``A. Quill``), possessive or not. It names
someone *unknown* when it holds a phrase written like a person's name (two or more capitalised words, or a title and
a name: ``Mrs. Okafor``; not a clinician's, ``Dr Smith``) that matches no subject the key opens. Whether that someone is another
clinician's patient or nobody at all is not looked up: both get the same refusal, so it reveals nothing.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping

# a word of a name: letters, with inner apostrophes, hyphens or a trailing dot (O'Neil, Jean-Luc, J.)
_WORD = re.compile(r"[^\W\d_](?:[^\W\d_]|['\u2019-](?=[^\W\d_]))*\.?")
TITLES = {"mr", "mrs", "ms", "miss", "mx", "sir", "dame", "madam"}
STAFF = {"dr", "prof", "doctor", "nurse", "professor"}  # a name after these is a clinician's, not a subject's
# capitalised words that start questions and sentences, or name times and record parts, never people
NOT_NAMES = set("""
a an the and or but of for to in on at by with from about after before during since until into than then as
is are was were be been being do does did has have had can could will would shall should may might must
what when where which who whom whose why how whether if please tell give list show summarise summarize describe
explain find compare i my me we our you your he she his her him they their them it its this that these those
there here any all each every some no not yes patient patients record records chart notes note doctor nurse
january february march april may june july august september october november december
monday tuesday wednesday thursday friday saturday sunday today yesterday tomorrow
""".split())


def fold(word: str) -> str:
    """A word as names are compared: lower case, accents off, no dot or apostrophe ('O'Neil' -> 'oneil')."""
    plain = unicodedata.normalize("NFKD", word).encode("ascii", "ignore").decode() or word
    return re.sub(r"['\u2019.]", "", plain.lower())


def words(text: str) -> list[tuple[str, str]]:
    """The words of `text`, each as written and as compared; a possessive 's is dropped."""
    out = []
    for match in _WORD.finditer(text):
        written = re.sub(r"['\u2019]s$", "", match.group())
        out.append((written, fold(written)))
    return out


def check_subject(subject: object) -> str | None:
    """`subject` cleaned (spaces collapsed), or None for none; raises ValueError naming what is wrong."""
    if subject is None:
        return None
    if not isinstance(subject, str) or not subject.strip() or len(subject) > 200 or not subject.isprintable():
        raise ValueError(f"subject={subject!r:.80} must be a name of 1-200 printable characters, e.g. 'Ada Quill'.")
    if not any(len(f) > 1 for _, f in words(subject)):
        raise ValueError(f"subject={subject!r} holds no word of two letters or more to match a question by.")
    return " ".join(subject.split())


def same_name(said: list[str], subject: list[str]) -> bool:
    """Whether the folded words `said` name `subject`: each said word is a distinct subject word, or its initial;
    at least one in full. Order is free (family name first or last); a middle name may be left out."""
    left = list(subject)
    full = False
    for word in said:
        match = next((s for s in left if s == word), None) or \
            next((s for s in left if len(word) == 1 and s.startswith(word)), None)
        if match is None:
            return False
        left.remove(match)
        full = full or len(word) > 1
    return full


def named(question: str, subjects: Mapping[str, str]) -> list[str]:
    """The cartridges (keys of `subjects`: name -> subject) whose subject `question` names, in any case."""
    said = [f for _, f in words(question)]
    phrases = [[fold(w) for w in phrase] for phrase in name_phrases(question)]
    found = []
    for cartridge, subject in subjects.items():
        target = [f for _, f in words(subject)]
        size = len(target)
        # a window of the question as long as the name (or one shorter: a middle name left out); a lone word only
        # when the subject is one word (a module), or when it is written as a name (Mrs Quill, below)
        spans = {n for n in (size, size - 1) if n >= min(2, size)}
        if any(same_name(said[i:i + n], target) for n in spans for i in range(len(said) - n + 1)):
            found.append(cartridge)
            continue
        if any(same_name(phrase, target) for phrase in phrases):
            found.append(cartridge)
    return found


def name_phrases(question: str) -> list[list[str]]:
    """Phrases written like a person's name: runs of two or more capitalised words that are not question or
    calendar words (``Ada Quill``, ``Quill, Ada``, ``A. Quill``), or a title and one or more (``Mrs Quill``); not a
    name after a clinician's title (``Dr Smith``: staff, not a subject)."""
    phrases, run = [], []
    tokens = list(_WORD.finditer(question))
    for i, match in enumerate(tokens):
        written = re.sub(r"['\u2019]s$", "", match.group())
        gap = question[tokens[i - 1].end():match.start()] if i else ""
        if run and gap.strip(" ,") or (run and gap.count(",") > 1):  # a run is broken by anything but spaces, a comma
            phrases.append(run)
            run = []
        # capitalised, or a family name in capitals (QUILL); not an acronym of two or three letters (CT, MRI)
        capital = written[0].isupper() and not (written.isupper() and 1 < len(written.rstrip(".")) < 4)
        initial = len(written) == 2 and written.endswith(".")  # "A." is an initial, not the article
        if capital and (initial or fold(written) not in NOT_NAMES - TITLES - STAFF):
            run.append(written)
        elif run:
            phrases.append(run)
            run = []
    if run:
        phrases.append(run)
    out = []
    for phrase in phrases:
        if fold(phrase[0]) in STAFF:
            continue
        titled = fold(phrase[0]) in TITLES
        name = phrase[1:] if titled else phrase
        if name and (titled or len(name) >= 2):
            out.append(name)
    return out


def unknown_name(question: str) -> str | None:
    """The first phrase of `question` written like a person's name, as written; None when there is none."""
    phrases = name_phrases(question)
    return " ".join(phrases[0]) if phrases else None
