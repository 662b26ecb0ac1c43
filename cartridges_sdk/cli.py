"""The ``cartridges`` command: make, inspect, compose and query cartridge files from a shell."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .errors import CartridgeError, ConfigError


def _model_for(spec: str | None, device: str = "cpu"):
    """The model named on the command line, else the embedded default. Never the one a file's metadata names: a file
    must not choose a path to load (its model identity is only compared with the model loaded here)."""
    from .models import DEFAULT_MODEL_SOURCE, load_model

    if spec in (None, "", DEFAULT_MODEL_SOURCE):
        return load_model(device=device)
    return load_model(spec, device=device)


def _bind_all(cartridges: list[Any], lm: Any, flag: str = "--model") -> list[Any]:
    """`cartridges` bound to `lm`; a misfit names the model the file says it was made for and the flag to pass."""
    from .errors import IncompatibleCartridgeError

    bound = []
    for c in cartridges:
        try:
            bound.append(c.bind(lm))
        except IncompatibleCartridgeError as err:
            err.add_note(f"The file was made for {c.meta.model.name!r}; to use it, pass {flag} with that model (a "
                         "model id, directory or .gguf); the file's own metadata never picks what is loaded.")
            raise
    return bound


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def cmd_init(args: argparse.Namespace) -> int:
    from .cartridge import Cartridge

    text = _text_file(args.text) if args.init == "prefix" else None
    Cartridge._check_size(args.tokens, args.num_frozen)
    _output_file(args.output)
    lm = _model_for(args.model, device=args.device)
    if text is not None:
        c = Cartridge.from_prefix(lm, text, args.tokens, num_frozen=args.num_frozen)
    elif args.init == "random_text":
        c = Cartridge.from_random_text(lm, args.tokens, seed=args.seed, num_frozen=args.num_frozen)
    else:
        c = Cartridge.random(lm, args.tokens, seed=args.seed, num_frozen=args.num_frozen)
    c.save(args.output)
    print(f"wrote {args.output}: {c.num_tokens} tokens, {_human_bytes(c.nbytes)}, init={c.meta.init}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    import time

    import attrs

    from .cartridge import Cartridge
    from .build.compaction import CompactionConfig

    corpus = _corpus(args)
    known = {f.name for f in attrs.fields(CompactionConfig)}
    settings = parse_settings(args.set)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise CartridgeError(f"--set {unknown[0]!r} is not a compaction setting; known: {sorted(known)}.")
    config = CompactionConfig(**settings)
    Cartridge._check_size(args.tokens, args.num_frozen)
    _output_file(args.output)
    lm = _model_for(args.model, device=args.device)
    start = time.perf_counter()
    c = Cartridge.compact(lm, corpus, args.tokens, num_frozen=args.num_frozen, config=config)
    seconds = time.perf_counter() - start
    c.save(args.output)
    info = c.meta.extra["compaction"]
    print(f"wrote {args.output}: {c.num_tokens} tokens standing in for {info['corpus_tokens']} "
          f"({info['corpus_tokens'] / c.num_tokens:.1f}x fewer, {len(info['chunks'])} chunk(s)), "
          f"{_human_bytes(c.nbytes)}, in {seconds:.0f} s")
    return 0


def _output_file(name: str) -> None:
    """Refuse an output path that is a folder before any work (the write at the end would fail)."""
    if Path(name).is_dir():
        raise CartridgeError(f"-o {name!r} is a folder; give a file path, e.g. {str(Path(name) / 'out.safetensors')!r}.")


def _text_file(name: str) -> str:
    from .build.corpus import _read_text

    path = Path(name)
    if path.is_dir():
        raise CartridgeError(f"{name!r} is a folder; give one text file (`cartridges build` learns a whole folder).")
    if not path.is_file():
        raise CartridgeError(f"No file at {name!r}; check the path.")
    text = _read_text(path)
    if text is None:
        raise CartridgeError(f"{name!r} is not UTF-8 text (binary, or another encoding); convert it to UTF-8 text.")
    return text


def cmd_inspect(args: argparse.Namespace) -> int:
    from .cartridge import SHAPE_FIELDS, Cartridge

    c = Cartridge.load(args.path)
    meta = c.meta.to_dict()
    if args.json:
        print(json.dumps({**meta, "nbytes": c.nbytes, "num_layers": c.num_layers}, indent=2))
        return 0
    m = c.meta.model
    kv_heads, _, head_dim = c.keys[0].shape
    rows = [
        ("file", str(args.path)),
        ("model", f"{m.name}" + (f" (source: {m.source})" if m.source and m.source != m.name else "")
         + ("" if all(f in m.architecture for f in SHAPE_FIELDS) else " (architecture not reported: no model will "
            "take it)")),
        ("model fingerprint", m.fingerprint),
        ("tokens", f"{c.num_tokens} ({c.num_frozen} frozen)"),
        ("shape", f"{c.num_layers} layers x [{kv_heads} kv heads, {c.num_tokens} tokens, {head_dim} head dim]"),
        ("dtype", c.meta.dtype),
        ("size", _human_bytes(c.nbytes)),
        ("init", c.meta.init),
    ]
    if c.meta.corpus:
        rows.append(("corpus", ", ".join(f"{k}={v}" for k, v in c.meta.corpus.items())))
    if c.meta.parts:
        spans = [f"[{p['offset']}:{p['offset'] + p['num_tokens']}]" for p in c.meta.parts]
        rows.append(("parts", f"{len(c.meta.parts)}: " + " ".join(spans)))
    if c.meta.training:
        rows.append(("training", json.dumps(c.meta.training)))
    rows += [("created", c.meta.created), ("sdk version", c.meta.sdk_version), ("format version", str(c.meta.format_version))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_compose(args: argparse.Namespace) -> int:
    from .cartridge import Cartridge

    parts = [Cartridge.load(p) for p in args.paths]
    lm = _model_for(args.model, device=args.device) if args.reposition else None
    if lm is not None:
        parts = _bind_all(parts, lm)
    c = Cartridge.compose(parts, reposition=args.reposition, model=lm)
    c.save(args.output)
    print(f"wrote {args.output}: {len(parts)} parts, {c.num_tokens} tokens, {_human_bytes(c.nbytes)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from .checks import is_loopback
    from .serve.server import ServeConfig, allowed_hosts, create_app
    from .serve.store import CartridgeStore

    options = backend_options(args, {"runtime": args.runtime})["runtime"]
    key = args.api_key or os.environ.get("CARTRIDGES_API_KEY") or None
    config = ServeConfig(api_key=key, max_queue=args.max_queue, max_batch=args.max_batch,
                         allowed_hosts=allowed_hosts(args.host, args.allowed_host))  # checked before the model loads
    lm = _model_for(args.model, device=args.device)
    store = CartridgeStore(args.store, lm, memory_budget=args.memory_mb * 2**20)
    if key is None and not is_loopback(args.host):
        print(f"warning: serving on {args.host} with no API key; anyone who can reach it can use it "
              "(--api-key or CARTRIDGES_API_KEY)", file=sys.stderr)
    runtime = lm.get_runtime(args.runtime, **options)
    refused = store.refused()
    hosts = "any Host" if config.allowed_hosts is None else "Host " + ", ".join(config.allowed_hosts)
    print(f"serving {len(store)} cartridge(s) from {args.store} on http://{args.host}:{args.port}/v1 "
          f"(runtime {args.runtime}; answering {hosts}{'; left out: ' + ', '.join(refused) if refused else ''})",
          file=sys.stderr)
    try:
        uvicorn.run(create_app(store, runtime, config), host=args.host, port=args.port, log_level="warning")
    finally:
        lm.close()
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from .cartridge import Cartridge

    cartridges = [Cartridge.load(p) for p in args.cartridge]
    options = backend_options(args, {"runtime": args.runtime})["runtime"]
    lm = _model_for(args.model, device=args.device)
    cartridges = _bind_all(cartridges, lm)
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed is not None:
        gen["seed"] = args.seed
    try:
        if args.stream:
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


def parse_settings(pairs: list[str], flag: str = "--set", example: str = "lr=0.01") -> dict[str, Any]:
    """``--set key=value`` pairs; values are read as JSON when they parse (numbers, true/false, lists)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CartridgeError(f"{flag} {pair!r} must look like key=value, e.g. {flag} {example}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def backend_options(args: argparse.Namespace, roles: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``--backend-option [ROLE.]KEY=VALUE`` pairs sorted to the command's backends (`roles`: role -> name).

    With one backend the role may be left out; with two, a bare key goes to the one that declares it.
    """
    from .plugins import REGISTRIES

    pairs = parse_settings(args.backend_option, "--backend-option", "autocast_dtype=bfloat16")
    out: dict[str, dict[str, Any]] = {role: {} for role in roles}
    declared = {role: REGISTRIES[role + "s"].get(name).option_names() for role, name in roles.items()}
    for key, value in pairs.items():
        role, dot, bare = key.partition(".")
        if dot and role in roles:
            out[role][bare] = value
            continue
        takers = [r for r in roles if key in declared[r]] if len(roles) > 1 else list(roles)
        if len(takers) != 1:
            choices = "; ".join(f"{r} {roles[r]!r}: {declared[r] or 'none'}" for r in roles)
            raise CartridgeError(
                f"--backend-option {key!r} is {'declared by both backends' if takers else 'not an option of any backend'}"
                f" ({choices}); write it as ROLE.{key}, ROLE one of {sorted(roles)}."
            )
        out[takers[0]][key] = value
    for role, name in roles.items():  # unknown or bad options are refused here, before any model loads
        REGISTRIES[role + "s"].get(name).parse_options(out[role], f"{role} {name!r}")
    return out


def cmd_backends(args: argparse.Namespace) -> int:
    from .plugins import REGISTRIES

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
                extra += "; " + ", ".join(f"{CAPABILITY_WORDS.get(k, k)}: {_yes(v)}" for k, v in row["capabilities"].items())
            print(f"  {row['name']:<12} ok      {row['target']} ({origin}){extra}")
    return 0


CAPABILITY_WORDS = {"max_top_logprobs": "top-k up to", "score": "scores sequences", "prefix_reuse": "prefix reuse",
                    "distributed": "joins torchrun"}


def _yes(value: Any) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _corpus(args: argparse.Namespace):
    from .build.corpus import Corpus

    paths = [Path(p) for p in args.corpus]
    if len(paths) == 1 and paths[0].is_dir():
        return Corpus.from_directory(paths[0], include=args.include, exclude=args.exclude, description=args.description)
    return Corpus.from_files([str(p) for p in paths], description=args.description)


def _start_ranks(args: argparse.Namespace, trainer_options: dict[str, Any] | None = None) -> int | None:
    """With ``--nproc N`` (N > 1) outside torchrun: run this command as N ranks on this machine and return their exit
    code. Otherwise (one process, or a rank) None: go on here, on this rank's own device."""
    from .build.distributed import launch, rank_device, under_torchrun
    from .build.training import check_shardable
    from .plugins import trainers

    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be at least 1.")
    if (trainer_options or {}).get("shard_model") and not under_torchrun():  # before the model loads
        check_shardable(args.nproc)
    trainer = getattr(args, "trainer", None)
    if args.nproc > 1 and trainer and not trainers.get(trainer).capabilities_for(trainer_options or {}).distributed:
        raise ConfigError(f"--nproc runs training data-parallel under torchrun; trainer {trainer!r} does not join a "
                          "process group (its capabilities.distributed is False). Drop --nproc, or use a trainer "
                          "that does, e.g. --trainer torch.")
    if args.nproc > 1 and not under_torchrun():
        return launch(["cartridges_sdk.cli", *_without_option(args.argv, "--nproc")], args.nproc)
    args.device = rank_device(args.device)
    return None


def cmd_build(args: argparse.Namespace) -> int:
    from .cartridge import Cartridge
    from .build.distributed import is_lead
    from .build.selfstudy import check_settings

    settings = parse_settings(args.set)
    check_settings(settings, num_tokens=args.tokens, num_conversations=args.conversations, epochs=args.epochs,
                   init=args.init, seed=args.seed)
    options = backend_options(args, {"synthesizer": args.synthesizer, "trainer": args.trainer})
    _output_file(args.output)
    ranks_exit = _start_ranks(args, options["trainer"])  # after the checks: a mistake is said once, not by every rank
    if ranks_exit is not None:
        return ranks_exit
    lm = _model_for(args.model, device=args.device)
    work = Path(args.work_dir) if args.work_dir else Path(str(args.output) + ".work")
    c = Cartridge.from_corpus(
        _corpus(args), lm, num_tokens=args.tokens, num_conversations=args.conversations, epochs=args.epochs,
        init=args.init, seed=args.seed, output_dir=work, synthesizer=args.synthesizer,
        synthesizer_options=options["synthesizer"], trainer=args.trainer, trainer_options=options["trainer"],
        allow_unverified_model=args.allow_unverified_model, restart=args.restart, **settings,
    )
    if is_lead():  # every rank holds the same cartridge; one writes it
        c.save(args.output)
        print(f"wrote {args.output}: {c.num_tokens} tokens, {_human_bytes(c.nbytes)} (work files in {work})")
    return 0


def _stage_settings(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    """The `--set` settings of one stage (`synthesize` or `train`); the other stage's are refused by name."""
    from .build.selfstudy import split_settings

    synth, train = split_settings(parse_settings(args.set))
    mine, other, other_stage = (synth, train, "train") if stage == "synthesize" else (train, synth, "synthesize")
    if other:
        raise CartridgeError(f"{sorted(other)} are settings of `cartridges {other_stage}`; pass them there.")
    return mine


def cmd_synthesize(args: argparse.Namespace) -> int:
    from .build.dataset import Shard
    from .build.distributed import is_lead, under_torchrun
    from .plugins import synthesizers
    from .build.synthesis import SynthesisConfig, check_capabilities, synthesize

    shard = Shard.parse(args.shard) if args.shard else None
    if shard is not None and (args.nproc > 1 or under_torchrun()):
        raise ConfigError("--shard makes one shard in one process; with --nproc (or torchrun) the ranks already share "
                          "the work. Use one or the other.")
    synth = _stage_settings(args, "synthesize")
    config = SynthesisConfig(num_conversations=args.conversations, seed=args.seed, **synth)
    options = backend_options(args, {"synthesizer": args.synthesizer})["synthesizer"]
    check_capabilities(config, synthesizers.get(args.synthesizer).capabilities_for(options),
                       f"synthesizer {args.synthesizer!r}")
    ranks_exit = _start_ranks(args)
    if ranks_exit is not None:
        return ranks_exit
    lm = _model_for(args.model, device=args.device)
    with synthesizers.create(args.synthesizer, lm, **options) as sampler:
        ds = synthesize(_corpus(args), lm, args.output, config, synthesizer=sampler,
                        allow_unverified_model=args.allow_unverified_model, restart=args.restart, shard=shard)
    if is_lead():
        what = (f" (shard {shard.index} of {shard.count}; gather the shards with `cartridges merge`)"
                if shard and shard.count > 1 else "")
        print(f"wrote {args.output}: {_dataset_summary(ds)}{what}")
    return 0


def _dataset_summary(ds: Any) -> str:
    from .build.dataset import SEED_KIND_DOCUMENT

    windows = sum(c.seed_kind == SEED_KIND_DOCUMENT for c in ds)
    missing = ds.missing_groups()
    return f"{len(ds) - windows} conversations, {windows} document windows" + (
        f"; {len(missing)} group(s) missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}" if missing else "")


def cmd_merge(args: argparse.Namespace) -> int:
    from .build.dataset import merge

    ds = merge(args.sources, args.output)
    missing = ds.missing_groups()
    print(f"wrote {args.output}: {_dataset_summary(ds)}")
    if missing:
        print("the shards that hold the missing groups are not among the sources, or are unfinished; run the same "
              f"`cartridges synthesize` with -o {args.output} to make what is missing", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .build.dataset import SelfStudyDataset
    from .build.distributed import is_lead
    from .build.selfstudy import train_cartridge

    train = _stage_settings(args, "train")
    from .build.selfstudy import check_settings

    check_settings(train, num_tokens=args.tokens, epochs=args.epochs, init=args.init, seed=args.seed)
    options = backend_options(args, {"trainer": args.trainer})["trainer"]
    _output_file(args.output)
    dataset = SelfStudyDataset(args.data)
    work = Path(args.work_dir) if args.work_dir else Path(str(args.output) + ".work")
    from .build.selfstudy import COMPACT_START, check_compact, check_dataset_corpus, check_whole

    check_whole(dataset)
    # the start is rank 0's to make (the built-in trainer sends it to the others): they need not read the corpus
    needs_corpus = args.corpus and (is_lead() or args.trainer != "torch")
    corpus = _corpus(args) if needs_corpus else None
    # before the model loads: a corpus given must be the dataset's; without one, the start comes from the corpus the
    # dataset keeps (checked here), and a dataset made before datasets kept it cannot be compacted
    if corpus is not None:
        check_dataset_corpus(dataset, corpus)
    elif not args.corpus and args.init in ("compact", "prefix") and is_lead():
        if (dataset.corpus_text() is None and args.init == "compact"
                and (args.restart or not (work / COMPACT_START).is_file())):
            check_compact(None, args.tokens)
    ranks_exit = _start_ranks(args, options)
    if ranks_exit is not None:
        return ranks_exit
    lm = _model_for(args.model, device=args.device)  # the dataset's recorded model is compared, never loaded
    prefix_ids = lm.encode(corpus.text) if corpus is not None else None
    c = train_cartridge(
        dataset, lm, num_tokens=args.tokens, epochs=args.epochs, init=args.init, seed=args.seed,
        prefix_ids=prefix_ids, output_dir=work, trainer=args.trainer, trainer_options=options, restart=args.restart,
        **train,
    )
    if is_lead():  # every rank holds the same cartridge; one writes it
        c.save(args.output)
        print(f"wrote {args.output}: {c.num_tokens} tokens, {_human_bytes(c.nbytes)}")
    return 0


def _without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without option `name` and its value (``--name V``, ``--name=V``, or an abbreviation argparse took):
    torchrun reads its own ``--nproc-per-node`` from any ``--nproc`` it sees, even after the module's name."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if len(flag) > 2 and flag.startswith("--") and name.startswith(flag) and flag != "--":
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cartridges", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="model id, directory or .gguf (default: the embedded default model; a file's "
                       "metadata never chooses it)")
        p.add_argument("--device", default="cpu", help="torch device (default: cpu)")

    p = sub.add_parser("init", help="make an untrained cartridge (KV of a text's first tokens, unrelated text, or random)")
    p.add_argument("text", nargs="?", help="text file whose first tokens become the cartridge (for --init prefix)")
    p.add_argument("-o", "--output", required=True, help="cartridge file to write (.safetensors)")
    p.add_argument("--tokens", type=int, required=True, help="cartridge size p in tokens")
    p.add_argument("--init", choices=["prefix", "random_text", "random"], default="prefix")
    p.add_argument("--num-frozen", type=int, default=1, help="leading tokens that never train (default 1)")
    p.add_argument("--seed", type=int, default=0)
    model_args(p)
    p.set_defaults(func=cmd_init)

    def corpus_args(p: argparse.ArgumentParser, required: bool = True) -> None:
        p.add_argument("corpus", nargs="+" if required else "*", help="a directory, or files / glob patterns")
        p.add_argument("--include", action="append", help="glob for files in a directory (repeatable; default all)")
        p.add_argument("--exclude", action="append", help="glob for files to leave out (repeatable)")
        p.add_argument("--description", help="text placed before every chunk the teacher reads")

    p = sub.add_parser("compact", help="make a cartridge in seconds, with no training, by KV compaction of a corpus")
    corpus_args(p)
    p.add_argument("-o", "--output", required=True, help="cartridge file to write (.safetensors)")
    p.add_argument("--tokens", type=int, required=True, help="cartridge size p in tokens")
    p.add_argument("--num-frozen", type=int, default=1, help="leading tokens that never train later (default 1)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a CompactionConfig setting, e.g. --set corpus_queries=2048 (repeatable)")
    model_args(p)
    p.set_defaults(func=cmd_compact)

    def study_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--restart", action="store_true",
                       help="start over: delete this command's earlier work in its folder instead of resuming it")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="any synthesis or training setting, e.g. --set lr=0.01 --set max_chunk=2048 (repeatable)")
        model_args(p)

    def nproc_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--nproc", type=int, default=1,
                       help=f"{what} this many processes on this machine (torchrun; default 1)")

    def backend_args(p: argparse.ArgumentParser, *roles: str) -> None:
        defaults = {"synthesizer": "hf", "trainer": "torch", "runtime": "hf"}
        for role in roles:
            p.add_argument(f"--{role}", default=defaults[role],
                           help=f"{role} backend by name (default {defaults[role]}; `cartridges backends` lists them)")
        p.add_argument("--backend-option", action="append", metavar="[ROLE.]KEY=VALUE",
                       help="an option of the chosen backend, e.g. --backend-option autocast_dtype=bfloat16 (repeatable)")
        if "synthesizer" in roles:
            p.add_argument("--allow-unverified-model", action="store_true",
                           help="synthesize even if the synthesizer cannot show it serves the student's model (recorded)")

    p = sub.add_parser("build", help="self-study: synthesize conversations about a corpus, then train a cartridge")
    corpus_args(p)
    p.add_argument("-o", "--output", required=True, help="cartridge file to write")
    p.add_argument("--tokens", type=int, required=True, help="cartridge size p in tokens")
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--init", choices=["compact", "prefix", "random_text", "random"], default="compact",
                   help="where training starts (default compact: the corpus compacted, see docs/compaction.md)")
    p.add_argument("--work-dir", help="where data and checkpoints go (default OUTPUT.work); a re-run resumes")
    nproc_arg(p, "synthesize and train (data-parallel) in")
    study_args(p)
    backend_args(p, "synthesizer", "trainer")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("synthesize", help="self-study data only: write conversations to a dataset folder")
    corpus_args(p)
    p.add_argument("-o", "--output", required=True, help="dataset folder (e.g. data.parquet); a re-run resumes")
    p.add_argument("--conversations", type=int, default=128)
    nproc_arg(p, "share the synthesis among")
    p.add_argument("--shard", metavar="I/N", help="make only shard I of N (from 0) in this process, e.g. one per "
                   "machine; `cartridges merge` gathers them into the dataset one process makes")
    study_args(p)
    backend_args(p, "synthesizer")
    p.set_defaults(func=cmd_synthesize)

    p = sub.add_parser("merge", help="gather the shards of one synthesis (`synthesize --shard I/N`) into one dataset")
    p.add_argument("sources", nargs="+", help="dataset folders made with the same settings")
    p.add_argument("-o", "--output", required=True, help="dataset folder to write (new, or one to add to)")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("train", help="train a cartridge on a dataset made by `cartridges synthesize`")
    p.add_argument("data", help="dataset folder")
    p.add_argument("-o", "--output", required=True, help="cartridge file to write")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--init", choices=["compact", "prefix", "random_text", "random"], default="compact",
                   help="where training starts (default compact: the corpus compacted, see docs/compaction.md)")
    p.add_argument("--corpus", nargs="*", default=None,
                   help="the corpus, checked against the one the dataset was made from (the dataset keeps its corpus; "
                        "only a dataset made before it kept one needs this for the default init=compact)")
    p.add_argument("--include", action="append")
    p.add_argument("--exclude", action="append")
    p.add_argument("--description")
    p.add_argument("--work-dir", help="where checkpoints go (default OUTPUT.work); a re-run resumes")
    nproc_arg(p, "train data-parallel in")
    study_args(p)
    backend_args(p, "trainer")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("inspect", help="show what a cartridge file holds")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the metadata as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("compose", help="concatenate cartridges into one")
    p.add_argument("paths", nargs="+", help="cartridge files, in order")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--reposition", action="store_true", help="rotate later parts' keys to the positions they occupy")
    model_args(p)
    p.set_defaults(func=cmd_compose)

    p = sub.add_parser("ask", help="answer a question with one or more cartridges as context")
    p.add_argument("cartridge", nargs="+", help="cartridge file(s); several are used one after another")
    p.add_argument("question")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    model_args(p)
    backend_args(p, "runtime")
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("serve", help="serve a folder of cartridges over an OpenAI-compatible HTTP API")
    p.add_argument("--store", required=True, help="folder of NAME.safetensors (and NAME.corpus.txt for routing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="bearer token clients must send (default: CARTRIDGES_API_KEY, else none)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting before 429 (default 256)")
    p.add_argument("--max-batch", type=int, default=16, help="requests answered together at most (default 16)")
    p.add_argument("--memory-mb", type=int, default=1024,
                   help="cartridges kept loaded, in MiB; least recently used out first (default 1024)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a name clients reach the server by, accepted in the Host header (repeatable). On a loopback "
                        "address only loopback names are answered (against DNS rebinding); elsewhere any name, unless "
                        "some are given. '*': any name")
    model_args(p)
    backend_args(p, "runtime")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("backends", help="list installed runtimes, synthesizers and trainers, and whether each imports")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(func=cmd_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what `--nproc` starts again as each rank
    if getattr(args, "init", None) == "prefix" and args.command == "init" and not args.text:
        parser.error("init --init prefix needs a text file")
    try:
        return args.func(args)
    except CartridgeError as err:
        print(f"error: {err}", file=sys.stderr)
        for note in getattr(err, "__notes__", []):
            print(f"note: {note}", file=sys.stderr)
        return 2
    except (OSError, UnicodeError) as err:  # a file the user named cannot be read or written
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
