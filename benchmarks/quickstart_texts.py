"""The quick start on texts it was not written for: the sample and the openings of four dev-split documents, each with
three questions that name a detail of its text, run through `examples/quickstart.py` exactly as a user runs it
(`--corpus FILE --question Q --answer A`). It reports, per text, how many questions each way of reading answers
right and how many of the whole text's right answers the cartridge keeps (docs/getting-started.md's table):

    python -m benchmarks.quickstart_texts [--texts sample,quality-1] [--model NAME] [-- QUICKSTART ARGS...]

Arguments after ``--`` go to every quick-start run (``--self-study``, ``--tokens 192``). The dev texts are
read from the evaluation data at run time and cut to their first ~2,300 characters (about 500 tokens).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from cartridges_sdk.errors import ConfigError

from . import provenance
from .data import EVALDATA

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"


@attrs.frozen
class Text:
    """A document's opening: the first `chars` characters of line `doc` of `data`, cut after the last `stop`
    (QuALITY's prose at a full stop, TPO's unpunctuated transcripts at a space). `questions` maps each question to
    the answer spellings the quick start marks it by ("a|b": either)."""

    data: str
    doc: int
    chars: int
    stop: str
    questions: dict[str, str]

    def read(self) -> str:
        path = EVALDATA / self.data
        lines = path.read_text(encoding="utf-8").splitlines()
        if not 0 <= self.doc < len(lines):
            raise ConfigError(f"{path} has {len(lines)} documents; document {self.doc} is not one of them.")
        head = json.loads(lines[self.doc])["input"][: self.chars]
        return head[: head.rfind(self.stop) + len(self.stop)].rstrip()


# the sample's own questions are the quick start's (no --corpus); the rest were written for these openings
TEXTS: dict[str, Text | None] = {
    "sample": None,
    "quality-1": Text("quality_dev.jsonl", 1, 2200, ".", {
        "Who wrote the book that described the President slipping away at night?": "Aldrich",
        "At which hotel were the trysts said to take place?": "Marriott",
        "Who passed on the rumor that was the book's source?": "Brock"}),
    "tpo-0": Text("tpo_dev.jsonl", 0, 2300, " ", {
        "What does Frantzen call her own style?": "realistic impressionism",
        "What color is the fence in the farm painting?": "blue",
        "Where did Frantzen go to watch how people move?": "sales barn"}),
    "quality-3": Text("quality_dev.jsonl", 3, 2300, ".", {
        "What were Ma Kirk and the younger ones huddled around?": "heat-stone|heat stone",
        "Whose talk does Ma Kirk say that kind of talk is?": "Randl",
        "What does Ma Kirk say that fool's talk gets you?": "sucking-plant|sucking plant"}),
    "tpo-2": Text("tpo_dev.jsonl", 2, 2300, " ", {
        "What is the hypothesis about earth's movements and climate called?": "milankovitch",
        "What is the second movement in the hypothesis?": "tilt",
        "What is the third movement the hypothesis covers called?": "precession"}),
}

_RIGHT = re.compile(r"^right answers: (.+)$", re.MULTILINE)
_COUNT = re.compile(r"([a-z -]+?) (\d+)/(\d+)(?:, |$)")  # "whole text 2/3": a way of reading, right of asked
_RUNTIME = re.compile(r"^answering with the (\S+) runtime", re.MULTILINE)
_KEPT = re.compile(r"^The \S+ cartridge answers (\d+) of the \d+ questions the whole text answers right", re.MULTILINE)


def summary(stdout: str) -> dict:
    """The quick start's verdict lines as numbers: right answers per way of reading, and what the cartridge keeps."""
    right = _RIGHT.search(stdout)
    if right is None:
        raise RuntimeError("the quick start printed no 'right answers:' line; its output ends:\n" + stdout[-2000:])
    found = _COUNT.findall(right.group(1))
    counts = {how: int(n) for how, n, _ in found}
    kept = _KEPT.search(stdout)
    runtime = _RUNTIME.search(stdout)
    # the last way of reading is the cartridge the quick start ends with; with no right answer from the whole text
    # it prints no "keeps" line, and keeps none of none
    return {"right": counts, "questions": int(found[0][2]), "cartridge": list(counts)[-1],
            "kept": int(kept.group(1)) if kept else 0, "whole_text_right": counts.get("whole text", 0),
            "runtime": runtime.group(1) if runtime else None}


def command(name: str, text_file: Path | None, work: Path, model: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, str(QUICKSTART), "--work-dir", str(work / name)]
    if model:
        cmd += ["--model", model]
    spec = TEXTS[name]
    if spec is not None:
        cmd += ["--corpus", str(text_file)]
        for q, a in spec.questions.items():
            cmd += ["--question", q, "--answer", a]
    return cmd + extra


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default=",".join(TEXTS), help=f"comma-separated, from {', '.join(TEXTS)}")
    parser.add_argument("--model", default=None, help="the quick start's --model (default: its own reader)")
    parser.add_argument("--work", type=Path, default=None, help="work folders (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quickstart_texts.json"))
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    names = [n for n in args.texts.split(",") if n]
    unknown = [n for n in names if n not in TEXTS]
    if unknown or not names:
        parser.error(f"--texts {args.texts!r}: choose from {', '.join(TEXTS)}")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in names:
            spec = TEXTS[name]
            text_file = None
            if spec is not None:
                text_file = Path(tmp) / f"{name}.txt"
                text_file.write_text(spec.read(), encoding="utf-8")
            start = time.perf_counter()
            print(f"{name}: running the quick start (its progress below)", flush=True)
            # stdout is read for the verdict; stderr (progress bars, the quality report) goes to the terminal
            run = subprocess.run(command(name, text_file, work, args.model, extra), stdout=subprocess.PIPE, text=True)
            if run.returncode:
                raise RuntimeError(f"the quick start failed on {name} (exit {run.returncode}; its error is above)")
            row = {"text": name, "seconds": round(time.perf_counter() - start, 1), **summary(run.stdout)}
            rows.append(row)
            print(f"{name}: " + ", ".join(f"{how} {n}/{row['questions']}" for how, n in row["right"].items())
                  + f"; the {row['cartridge']} cartridge keeps {row['kept']} of the whole text's "
                  f"{row['whole_text_right']} ({row['runtime']} runtime, {row['seconds']:.0f} s)", flush=True)
    kept, whole = sum(r["kept"] for r in rows), sum(r["whole_text_right"] for r in rows)
    print(f"in all: the cartridge answers {kept} of the {whole} questions the whole text answers right")
    result = {"model": args.model, "quickstart_args": extra, "commit": provenance.commit(),
              "machine": provenance.machine(), "rows": rows, "kept": kept, "whole_text_right": whole}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
