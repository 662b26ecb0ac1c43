"""Documented commands are code: every shell and Python block in README.md, docs/*.md and examples/*/README.md
runs here.

The rules (what a page author needs to know):

- **Which blocks.** Fenced blocks whose language is ``bash``, ``sh``, ``shell`` or ``console`` (shell; in
  ``console`` only the lines after a ``$ `` prompt) or ``python``. Other blocks (``text``, ``toml``, a bare fence:
  output, file layouts) are not run.
- **Every such block runs, or says why not.** A block that cannot run here carries a marker on the line right before
  its fence: ``<!-- docs-test: skip: REASON -->`` (it needs a GPU, several machines, a server this machine lacks, a
  pip install, or hours). `test_every_block_runs_or_is_marked_with_a_reason` fails on a marker without a reason, on
  an unknown ``docs-test`` directive, and on a table entry below that no longer matches a block; the page tests fail
  when an unmarked block fails. Keep markers rare: prefer making the block runnable.
- **One folder per page.** A page's blocks run in page order in a fresh temporary folder holding the files the docs
  name (the `materials` fixture): ``examples/`` (the repository's), a small ``my_repo/`` of .py and .md files, a short
  ``paper.txt``, ``harrow.txt``, a small ``docs/`` folder, cartridges ``harrow``/``a``/``b``/``c.safetensors`` and
  ``cartridges/keepers.safetensors`` (tiny prefix cartridges of the default model), and ``path/to/model_dir`` and
  ``path/to/model.gguf`` (a tiny model folder; the embedded model's GGUF). Files a block writes are there for the
  page's later blocks.
- **Shell blocks** run one by one with ``bash -e -o pipefail``, with ``.venv/bin`` first on the PATH.
- **Python blocks of a page run in one fresh interpreter, in order, in one namespace** (the "joined" rule: a later
  block continues an earlier one, as a reader types them, so ``lm`` and ``c`` carry over and the model loads once per
  page). A block that continues code its page does not show gets a declared setup (and optionally a check run after
  it) in `AROUND`.
- **Servers.** A block listed in `SERVERS` starts a long-running server: it runs in the background on a free port on
  127.0.0.1 (the page's port is substituted), the page goes on once the server answers, and the server is stopped
  when the page's other blocks have run.
- **Small settings.** `SUBSTITUTIONS` is the explicit table of what is changed before a block runs (self-study on 4
  conversations with tiny chunks and turns, 2 processes where the docs say 4 or 8, short answers, no quality report
  on the README's shell lines, placeholders such as ``MODEL_DIR``), each with the reason. Every entry must apply
  somewhere. Documented values that are cheap here (cartridge sizes, questions, file names) run as written.
- **Tiers.** Pages in `SLOW_PAGES` (vLLM engine starts, about a minute each; five torchrun launches; the long
  self-study, compaction and sync pages, and pages of 40 s or more whose code has tests of its own) run in the slow
  tier (``-m slow``); the others in the default tier.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import TEXT

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*/README.md"))]
SHELL_LANGS = {"bash", "sh", "console", "shell"}
RUN_LANGS = SHELL_LANGS | {"python"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
BLOCK_TIMEOUT = 600  # seconds for one block (the slowest here takes well under a minute)

# -- small settings -----------------------------------------------------------------------------------------------
# self-study in seconds: 4 conversations about 64-128-token chunks, 8-token turns, 2 short document windows
SMALL_SYNTHESIS = {"conversations_per_chunk": 4, "max_tokens_a": 8, "max_tokens_b": 8, "min_chunk": 64,
                   "max_chunk": 128, "document_windows": 2, "window_tokens": 32}
SMALL_FLAGS = "--conversations 4 " + " ".join(f"--set {k}={v}" for k, v in SMALL_SYNTHESIS.items())


@dataclass(frozen=True)
class Sub:
    """Replace `pattern` (a regex) by `replacement` in the blocks of `pages` (a regex on the page path) in `langs`."""

    pages: str
    langs: frozenset[str]
    pattern: str
    replacement: str
    why: str


PY, SH = frozenset({"python"}), frozenset(SHELL_LANGS)
SUBSTITUTIONS = [
    Sub(".*", SH, r"\bcartridges (build|synthesize) ", rf"cartridges \1 {SMALL_FLAGS} ",
        "self-study on small settings (the docs' own flags come after these and win, but for --conversations)"),
    Sub(".*", SH, r"--conversations \d+", "--conversations 4", "4 conversations, not 128: seconds, not minutes"),
    Sub(".*", PY, r"\bCartridge\.from_corpus\(", "docs_small(Cartridge.from_corpus)(",
        "from_corpus on the same small settings (docs_small adds them unless the block sets them)"),
    Sub(".*", PY, r"num_conversations=\d+", "num_conversations=4", "4 conversations, not 128"),
    Sub(r"docs/sync\.md", SH, r"--self-study --set num_conversations=\d+",
        "--self-study --set num_conversations=4 " + " ".join(f"--set {k}={v}" for k, v in SMALL_SYNTHESIS.items()),
        "self-study in seconds per document"),
    Sub(r"docs/sync\.md", PY, r'\{"num_conversations": \d+\}', repr({"num_conversations": 4, **SMALL_SYNTHESIS}),
        "self-study in seconds per document"),
    Sub(".*", SH, r"--nproc \d+", "--nproc 2", "two processes: this machine has 2 cores"),
    Sub(".*", SH, r"--tokens 2048\b", "--tokens 256", "the sample my_repo/ holds about 900 tokens; a compacted "
        "start needs at least p"),
    Sub(".*", SH, r"\bcartridges ask ", "cartridges ask --max-new-tokens 24 ", "short answers"),
    Sub(r"README\.md", SH, r"\bcartridges (compact|sync) ", r"cartridges \1 --no-report ",
        "no quality report on the shell lines (about 25 s a cartridge here): the README's Python block keeps it, and "
        "tests/test_quality_report.py runs the report's commands"),
    Sub(r"docs/(store|openai|sync|vs-rag)\.md", PY | SH, r"\b8000\b", "{port}", "the server listens on a free port"),
    Sub(r"docs/openai\.md", SH, r"\bMODEL_DIR\b", "{model_dir}", "the folder the SDK loads the default model from"),
    Sub(r"examples/codebase_assistant/README\.md", SH, r"^\.venv/bin/python (examples/codebase_assistant/assistant\.py)$",
        r"python \1 --source my_repo --model default --tokens 32 --max-tokens 8 --store store",
        "the sample my_repo/ with the embedded model, not httpx with the 0.5B reader (minutes); .venv/bin is first "
        "on the tests' PATH"),
    Sub(r"examples/medical_records/README\.md", SH, r"^\.venv/bin/python (examples/medical_records/app\.py)$",
        r"python \1 --patients 2 --model default --tokens 32 --max-tokens 8 --work work",
        "2 patients with the embedded model in the page's folder, not 6 with the 0.5B reader (minutes), and not "
        "into the repository's examples/"),
    Sub(r"docs/llamacpp\.md", SH, r"/models/my-model\.Q4_K_M\.gguf", "{gguf}",
        "a GGUF of the student's model: the embedded one"),
]

# -- blocks that continue code the page does not show: (page, a text unique to the block) -> (before, after) ---------
AROUND: dict[tuple[str, str], tuple[str, str]] = {
    ("docs/getting-started.md", "load_model(model, tokenizer)"): (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained('path/to/model_dir')\n"
        "tokenizer = AutoTokenizer.from_pretrained('path/to/model_dir')\n", ""),
    ("docs/plugins.md", 'runtime_options={"max_installed": 8}'): (
        "from cartridges_sdk import Cartridge, Corpus, load_model\n"
        "lm = load_model()\n"
        "c, a, b = (Cartridge.load(f'{n}.safetensors', model=lm) for n in 'cab')\n"
        "messages = [{'role': 'user', 'content': 'Who built the lighthouse?'}]\n"
        "corpus = Corpus.from_directory('my_repo/')\n", ""),
    ("docs/vllm.md", 'synthesizer="vllm"'): (
        "from cartridges_sdk import Cartridge, Corpus, load_model\n"
        "lm = load_model()\n"
        "corpus = Corpus.from_directory('my_repo/')\n", ""),
    ("docs/vllm.md", 'runtimes.create("vllm"'): (
        "msgs_a = [{'role': 'user', 'content': 'Who built it?'}]\n"
        "msgs_b = [{'role': 'user', 'content': 'When was it built?'}]\n"
        "cart_a, cart_b, cart_c = (Cartridge.load(f'{n}.safetensors', model=lm) for n in 'abc')\n", ""),
    ("docs/writing-a-backend.md", "class LogOptions"): (
        "import attrs\n"
        "from cartridges_example.log import _writable_path\n"
        "from cartridges_sdk import Runtime\n",
        "from cartridges_example.runtime import LoggingRuntime as _Real\n"
        "assert [f.name for f in attrs.fields(LogOptions)] == [f.name for f in attrs.fields(_Real.Options)]\n"
        "docs_same_methods(LoggingRuntime, _Real)\n"),
    ("docs/writing-a-backend.md", "class Runtime(Backend)"): (
        "from __future__ import annotations\n"
        "from collections.abc import Generator, Sequence\n"
        "from cartridges_sdk.kit import Backend, Completion, GenerationRequest\n",
        "import cartridges_sdk.plugins\n"
        "docs_same_methods(Runtime, cartridges_sdk.plugins.Runtime)\n"),
    ("docs/writing-a-backend.md", "class Synthesizer(Backend)"): (
        "from __future__ import annotations\n"
        "from collections.abc import Sequence\n"
        "from typing import ClassVar\n"
        "from cartridges_sdk import ModelIdentity\n"
        "from cartridges_sdk.kit import Backend, Completion, SynthesisRequest, SynthesizerCapabilities\n",
        "import cartridges_sdk.plugins\n"
        "docs_same_methods(Synthesizer, cartridges_sdk.plugins.Synthesizer)\n"),
    ("docs/writing-a-backend.md", "SynthesizerCapabilities(\n"): (
        "from cartridges_sdk import SynthesizerCapabilities\n", ""),
    ("docs/writing-a-backend.md", "def capabilities_with"): (
        "import attrs\n"
        "from cartridges_sdk import SynthesizerCapabilities\n",
        "import cartridges_sdk.plugins\n"
        "docs_same_signature(capabilities_with.__func__, cartridges_sdk.plugins.Synthesizer.capabilities_with)\n"),
    ("docs/writing-a-backend.md", "class Trainer(Backend)"): (
        "from __future__ import annotations\n"
        "from cartridges_sdk import Cartridge\n"
        "from cartridges_sdk.kit import Backend\n",
        "import cartridges_sdk.plugins\n"
        "docs_same_methods(Trainer, cartridges_sdk.plugins.Trainer)\n"),
    ("docs/writing-a-backend.md", "def test_runtime_keeps_the_contract"): (
        "", "test_runtime_keeps_the_contract()\ntest_synthesizer_keeps_the_contract()\n"),
}

# -- blocks that start a server: (page, text unique to the block) -> the path that answers once it is up ------------
SERVERS: dict[tuple[str, str], str] = {
    ("docs/store.md", "cartridges serve"): "/health",
    ("docs/sync.md", "cartridges serve"): "/health",
    ("docs/vs-rag.md", "cartridges serve"): "/health",
    ("docs/openai.md", "vllm.entrypoints.openai.api_server"): "/v1/models",
}

# the slow tier: pages whose blocks start vLLM engines (about a minute each on 2 CPU cores), the torchrun page (five
# launches of two ranks; tests/test_distributed.py runs the same paths in the default tier), and the long pages that
# make cartridges by self-study or sync several documents, or check several with the quality report (a minute or more
# each: their APIs have tests of their own, tests/test_quality_report.py runs the report's commands), and the pages
# of 40-95 s on 2 cores whose code has tests of its own (the RAG integrations: integrations/*/tests; the codebase
# assistant: tests/test_codebase_assistant.py; runtimes: tests/test_runtime_choice.py and backends/llamacpp/tests;
# the store: tests/test_store.py and tests/test_server.py), so that the default tier stays under 35 minutes
SLOW_PAGES = {"docs/vllm.md", "docs/openai.md", "docs/distributed.md", "docs/sync.md", "docs/getting-started.md",
              "docs/compaction.md", "docs/self-study.md", "docs/plugins.md", "examples/medical_records/README.md",
              "docs/quality-report.md", "docs/vs-rag.md", "examples/codebase_assistant/README.md", "docs/runtimes.md",
              "docs/llamacpp.md", "docs/store.md"}
PAGE_ENV = {"docs/openai.md": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "docs/vllm.md": {"VLLM_CPU_KVCACHE_SPACE": "1"}}

# Run first in every page's interpreter: the small settings, and the checks AROUND uses.
PRELUDE = f"""
import functools as _functools, inspect as _inspect

DOCS_SMALL = {{"num_conversations": 4, **{SMALL_SYNTHESIS!r}}}


def docs_small(from_corpus):
    '''`from_corpus` with the small settings, which the call's own keywords override.'''
    return _functools.partial(from_corpus, **DOCS_SMALL)


def docs_same_signature(doc, real):
    names = lambda f: [p for p in _inspect.signature(f).parameters if p != "cls"]
    assert names(doc) == names(real), f"{{doc.__qualname__}}{{names(doc)}} is documented; the code has {{names(real)}}"


def docs_same_methods(doc_cls, real_cls):
    for name, value in vars(doc_cls).items():
        if callable(value) and not name.startswith("__"):
            assert hasattr(real_cls, name), f"{{real_cls.__name__}} has no {{name}} (documented)"
            docs_same_signature(value, getattr(real_cls, name))
"""

DRIVER = r"""
import sys, traceback
sentinel = sys.argv[1]
ns = {"__name__": "__main__"}
for line in sys.stdin:
    path, label = line.rstrip("\n").split("\t")
    try:
        exec(compile(open(path, encoding="utf-8").read(), label, "exec"), ns)
        status = "ok"
    except BaseException:
        traceback.print_exc()
        status = "failed"
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"\n{sentinel} {status}", flush=True)
"""


# -- the blocks ---------------------------------------------------------------------------------------------------
@dataclass
class Block:
    page: str
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    skip: str | None = None  # the marker's reason
    problems: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and self.skip is None


def read_blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", lines[i])
        if not m:
            if MARKER.match(lines[i]) and not _marks_a_fence(lines, i):
                blocks.append(Block(page, i + 1, "", "", problems=["a docs-test marker not right before a fence"]))
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[end]):
            end += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        block = Block(page, i + 1, lang.lower(), "\n".join(body) + "\n")
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(prev)
        if marker:
            kind, _, reason = marker.group(1).partition(":")
            if kind.strip() != "skip":
                block.problems.append(f"unknown docs-test directive {marker.group(1)!r} (only 'skip: REASON')")
            elif not reason.strip():
                block.problems.append("a skip marker without a reason")
            else:
                block.skip = reason.strip()
        blocks.append(block)
        i = end + 1
    return blocks


def _marks_a_fence(lines: list[str], i: int) -> bool:
    nxt = next((ln for ln in lines[i + 1:] if ln.strip()), "")
    return nxt.lstrip().startswith("```")


ALL_BLOCKS = [b for page in PAGES for b in read_blocks(page)]


def _matches(key: tuple[str, str]) -> list[Block]:
    page, text = key
    return [b for b in ALL_BLOCKS if b.page == page and b.lang in RUN_LANGS and text in b.code]


def substituted(block: Block, values: dict[str, str] | None = None) -> tuple[str, list[Sub]]:
    """The block's code as it runs, and the substitutions that applied."""
    code, used = block.code, []
    if block.lang == "console":
        code = "\n".join(ln[2:] for ln in code.split("\n") if ln.startswith("$ ")) + "\n"
    for sub in SUBSTITUTIONS:
        if block.lang in sub.langs and re.fullmatch(sub.pages, block.page):
            code, n = re.subn(sub.pattern, sub.replacement, code)
            if n:
                used.append(sub)
    for name, value in (values or {}).items():
        code = code.replace("{" + name + "}", value)
    return code, used


# -- the static check ---------------------------------------------------------------------------------------------
def test_every_block_runs_or_is_marked_with_a_reason():
    problems = [f"{b.where}: {p}" for b in ALL_BLOCKS for p in b.problems]
    for table in (AROUND, SERVERS):
        for key in table:
            found = _matches(key)
            if len(found) != 1:
                problems.append(f"{key} matches {len(found)} runnable blocks, not 1")
            elif found[0].skip is not None:
                problems.append(f"{key} names a block marked skip ({found[0].where})")
    applied = {id(s) for b in ALL_BLOCKS if b.runs for s in substituted(b)[1]}
    problems += [f"substitution {s.pattern!r} ({s.why}) applies to no block that runs" for s in SUBSTITUTIONS
                 if id(s) not in applied]
    problems += [f"SLOW_PAGES names {p}, not a page with blocks that run" for p in SLOW_PAGES
                 if not any(b.runs and b.page == p for b in ALL_BLOCKS)]
    assert not problems, "\n".join(problems)
    # the rule is enforced by the page tests: every block that runs is in one of them
    assert {b.page for b in ALL_BLOCKS if b.runs} == set(RUN_PAGES)


# -- the materials the docs name ------------------------------------------------------------------------------------
MY_REPO = {
    "config.py": '''"""Reads the settings file of the tide-table service (settings.toml) and checks every value."""

import tomllib
from pathlib import Path

DEFAULTS = {"port": 8080, "harbour": "Harrow Point", "units": "metres", "refresh_minutes": 30}


def load_config(path: str | Path = "settings.toml") -> dict:
    """The settings in `path` over the defaults; an unknown key or a negative refresh interval is refused."""
    data = tomllib.loads(Path(path).read_text())
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(DEFAULTS)}")
    config = {**DEFAULTS, **data}
    if config["refresh_minutes"] <= 0:
        raise ValueError("refresh_minutes must be positive")
    return config
''',
    "tides.py": '''"""Tide predictions: the harmonic method with the main lunar and solar constituents."""

import math

M2_PERIOD_HOURS = 12.42  # the principal lunar semi-diurnal constituent
S2_PERIOD_HOURS = 12.00  # the principal solar semi-diurnal constituent


def height(hours: float, m2: float = 1.8, s2: float = 0.6, mean: float = 2.5) -> float:
    """Water height in metres `hours` after the reference high water."""
    return (mean + m2 * math.cos(2 * math.pi * hours / M2_PERIOD_HOURS)
            + s2 * math.cos(2 * math.pi * hours / S2_PERIOD_HOURS))


def next_high_water(after_hours: float, step: float = 0.05) -> float:
    """The first local maximum of `height` after `after_hours`, found by stepping forward."""
    t = after_hours
    while not (height(t) >= height(t - step) and height(t) >= height(t + step)):
        t += step
    return round(t, 2)
''',
    "server.py": '''"""The HTTP service: answers GET /tides?hours=N with the predicted height (port: config.py)."""

from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

from config import load_config
from tides import height


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        query = parse_qs(urlparse(self.path).query)
        body = f"{height(float(query.get('hours', ['0'])[0])):.2f}\\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)


def main():
    config = load_config()
    HTTPServer(("127.0.0.1", config["port"]), Handler).serve_forever()
''',
    "README.md": '''# Tide tables for Harrow Point

A small service that predicts the tides at Harrow Point. `config.py` parses the settings file (`settings.toml`);
`tides.py` holds the harmonic model (the M2 and S2 constituents); `server.py` answers HTTP requests with the
predicted water height. Run it with `python server.py` after writing a `settings.toml` such as:

    port = 8080
    units = "metres"
    refresh_minutes = 15

Heights are in metres above chart datum. The model ignores weather: a strong onshore wind can raise the water by
half a metre above the prediction.
''',
}

PAPER = """Tide Prediction with Two Constituents: An Evaluation at Harrow Point

Abstract. We ask how well a two-constituent harmonic model predicts the water level at a small harbour. We fit the
principal lunar (M2) and solar (S2) semi-diurnal constituents to one month of gauge readings and evaluate on the
Harrow Point Tide Gauge data set, eleven months of readings taken every six minutes by the harbour authority between
1998 and 1999. The model predicts the time of high water within 14 minutes on average and its height within 21
centimetres; adding the diurnal constituents K1 and O1 halves the height error. Storm surges, which the harmonic
method ignores by design, account for the ten largest errors.

1 Introduction. Harbour masters publish tide tables a year ahead. Most small harbours cannot afford the full
analysis with sixty constituents, so we measure what two constituents give. Our contribution is an evaluation on
public data with the errors broken down by season.

2 Data. The Harrow Point Tide Gauge data set holds 80,160 readings. We use January 1998 to fit the model and the
remaining eleven months to evaluate it. Readings during the gauge's repair in August 1998 are left out.

3 Method. The water height is modelled as a mean level plus a cosine for each constituent, with amplitudes and
phases fitted by least squares. The periods are fixed: 12.42 hours for M2 and 12.00 hours for S2.

4 Results. The mean absolute error of the height of high water is 21 cm (two constituents) and 10 cm (four). Errors
are largest in winter, when onshore gales raise the water. The time of high water is within 14 minutes on average.

5 Conclusion. Two constituents suffice for a rough table; four are worth their small cost.
"""

KEEPERS = ("The keepers of Harrow Point light: Thomas Reed kept it from 1871 to 1902, his daughter Anne Reed until "
           "1931, and the last keeper, Samuel Hale, until the light was automated in 1968.")


@pytest.fixture(scope="module")
def materials(tmp_path_factory, default_lm):
    """The files the docs name, made once; each page gets a copy."""
    from cartridges_sdk import Cartridge
    from cartridges_sdk.models import default_model_gguf
    from cartridges_sdk.testing import tiny_lm

    d = tmp_path_factory.mktemp("docs-materials")
    (d / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    for name, text in MY_REPO.items():
        (d / "my_repo").mkdir(exist_ok=True)
        (d / "my_repo" / name).write_text(text)
    (d / "paper.txt").write_text(PAPER)
    (d / "harrow.txt").write_text(TEXT)
    (d / "docs").mkdir()
    (d / "docs" / "index.md").write_text(MY_REPO["README.md"])
    (d / "docs" / "paper.md").write_text(PAPER)
    Cartridge.from_prefix(default_lm, TEXT, 64).save(d / "harrow.safetensors")
    for name, text in {"a": TEXT, "b": PAPER, "c": TEXT}.items():
        Cartridge.from_prefix(default_lm, text, 16).save(d / f"{name}.safetensors")
    (d / "cartridges").mkdir()
    Cartridge.from_prefix(default_lm, KEEPERS, 16).save(d / "cartridges" / "keepers.safetensors")
    (d / "cartridges" / "keepers.corpus.txt").write_text(KEEPERS)
    (d / "path" / "to").mkdir(parents=True)
    tiny = tiny_lm("llama")
    tiny.model.save_pretrained(d / "path" / "to" / "model_dir")
    tiny.tokenizer.save_pretrained(d / "path" / "to" / "model_dir")
    (d / "path" / "to" / "model.gguf").symlink_to(default_model_gguf())
    return d


# -- running a page -----------------------------------------------------------------------------------------------
def _env(page: str) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **PAGE_ENV.get(page, {})}
    env.pop("PYTHONPATH", None)  # as a user's shell has it: the installed package, not the test's path
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Interpreter:
    """One fresh Python process for a page's Python blocks, which run in it one after another in one namespace."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.sentinel = f"--docs-block-done-{uuid.uuid4().hex}--"
        self.cwd, self.n = cwd, 0
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", DRIVER, self.sentinel], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ok, out = self.run(PRELUDE, "<docs prelude>")
        assert ok, out

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, code: str, label: str) -> tuple[bool, str]:
        self.n += 1
        path = self.cwd / f".docs-block-{self.n}.py"
        path.write_text(code, encoding="utf-8")
        self.proc.stdin.write(f"{path}\t{label}\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + BLOCK_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False, "".join(out) + f"\n(timed out after {BLOCK_TIMEOUT} s)"
            if line is None:
                return False, "".join(out) + f"\n(the interpreter exited with {self.proc.wait()})"
            if line.startswith(self.sentinel):
                return line.split()[-1] == "ok", "".join(out)
            out.append(line)

    def close(self) -> None:
        _stop(self.proc)


class Server:
    """A shell block run in the background until the page is done; up once `url` answers."""

    def __init__(self, code: str, cwd: Path, env: dict[str, str], url: str):
        self.log = cwd / f".docs-server-{uuid.uuid4().hex[:8]}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        _stop(self.proc)
        raise AssertionError(f"the server did not come up at {url}:\n{self.log.read_text()[-4000:]}")

    def close(self) -> None:
        _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process this test started, and its children (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_page(page: str, workdir: Path, values: dict[str, str]) -> list[tuple[Block, float]]:
    env = _env(page)
    interpreter: Interpreter | None = None
    servers: list[Server] = []
    timings = []
    try:
        for block in (b for b in ALL_BLOCKS if b.page == page and b.runs):
            code, _ = substituted(block, values)
            start = time.monotonic()
            server = next((path for key, path in SERVERS.items() if _matches(key) == [block]), None)
            if server is not None:
                servers.append(Server(code, workdir, env, f"http://127.0.0.1:{values['port']}{server}"))
            elif block.lang == "python":
                before, after = next((v for key, v in AROUND.items() if _matches(key) == [block]), ("", ""))
                interpreter = interpreter or Interpreter(workdir, env)
                ok, out = interpreter.run(before + code + after, block.where)
                assert ok, f"{block.where} failed:\n{before + code + after}\n--- output ---\n{out[-6000:]}"
            else:
                done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=workdir, env=env,
                                      capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
                assert done.returncode == 0, (f"{block.where} failed ({done.returncode}):\n{code}\n--- stdout ---\n"
                                              f"{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-6000:]}")
            timings.append((block, time.monotonic() - start))
    finally:
        for s in servers:
            s.close()
        if interpreter is not None:
            interpreter.close()
    return timings


RUN_PAGES = [p for p in PAGES if any(b.runs and b.page == p for b in ALL_BLOCKS)]


@pytest.mark.default_model
@pytest.mark.parametrize("page", [pytest.param(p, marks=[pytest.mark.slow] if p in SLOW_PAGES else [])
                                  for p in RUN_PAGES])
def test_page_runs(page, materials, tmp_path, default_lm):
    workdir = tmp_path / "work"
    shutil.copytree(materials, workdir, symlinks=True)
    port = _free_port()
    values = {"port": str(port), "model_dir": str(default_lm.files),
              "gguf": str(materials / "path" / "to" / "model.gguf")}
    timings = run_page(page, workdir, values)
    print(json.dumps({b.where: round(t, 1) for b, t in timings}, indent=1))
