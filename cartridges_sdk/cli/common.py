"""What the ``cartridges`` commands share: the model a command loads, ``--set`` and ``--backend-option`` pairs, and
the corpus and files it names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import attrs

from .. import models
from ..making.corpus import Corpus, read_text
from ..making.settings import CompactionConfig, split_settings, with_recipe
from ..errors import CartridgeError, IncompatibleCartridgeError
from ..plugins import REGISTRIES
from ..runtime_choice import AUTO


def compaction_config(pairs: list[str] | None, flag: str = "--compaction",
                      base: CompactionConfig | None = None) -> CompactionConfig | None:
    """``KEY=VALUE`` pairs as a `CompactionConfig`, over `base` where one is given (a recipe's); `base` (None
    without one) when there are none. A name it lacks is refused, listing the ones it has."""
    settings = parse_settings(pairs, flag, "chunk_questions=8")
    if not settings:
        return base
    known = {f.name for f in attrs.fields(CompactionConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise CartridgeError(f"{flag} {unknown[0]!r} is not a compaction setting; known: {sorted(known)}.")
    return attrs.evolve(base, **settings) if base is not None else CompactionConfig(**settings)


def study_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """A self-study command's `Cartridge.from_corpus` keywords: its ``--recipe`` spelled out (`RECIPES`), with
    ``--set``, ``--conversations``, ``--epochs`` and ``--compaction`` over it (the last key by key)."""
    given = parse_settings(args.set)
    split_settings(given)  # an unknown name, or one with a flag of its own (--set epochs=2), is refused as such
    for key, value in (("num_conversations", args.conversations), ("epochs", args.epochs)):
        if value is not None:
            given[key] = value
    keywords = with_recipe({"recipe": args.recipe, "init": args.init, **given})
    del keywords["init"]  # an argument of its own
    keywords["compaction"] = compaction_config(args.compaction, base=keywords.get("compaction"))
    return keywords


def model_for(spec: str | None, device: str = "cpu"):
    """The model named on the command line, else the embedded default. Never the one a file's metadata names: a file
    must not choose a path to load (its model identity is only compared with the model loaded here)."""
    if spec in (None, "", models.DEFAULT_MODEL_SOURCE):
        return models.load_model(device=device)
    return models.load_model(spec, device=device)


def bind_all(cartridges: list[Any], lm: Any, flag: str = "--model") -> list[Any]:
    """`cartridges` bound to `lm`; a misfit names the model the file says it was made for and the flag to pass."""
    bound = []
    for c in cartridges:
        try:
            bound.append(c.bind(lm))
        except IncompatibleCartridgeError as err:
            err.add_note(f"The file was made for {c.meta.model.name!r}; to use it, pass {flag} with that model (a "
                         "named model, model id, directory or .gguf); the file's own metadata never picks what is "
                         "loaded.")
            raise
    return bound


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def output_file(name: str) -> None:
    """Refuse an output path that is a folder before any work (the write at the end would fail)."""
    if Path(name).is_dir():
        raise CartridgeError(f"-o {name!r} is a folder; give a file path, e.g. {str(Path(name) / 'out.safetensors')!r}.")


def text_file(name: str) -> str:
    path = Path(name)
    if path.is_dir():
        raise CartridgeError(f"{name!r} is a folder; give one text file (`cartridges build` learns a whole folder).")
    if not path.is_file():
        raise CartridgeError(f"No file at {name!r}; check the path.")
    text = read_text(path)
    if text is None:
        raise CartridgeError(f"{name!r} is not UTF-8 text (binary, or another encoding); convert it to UTF-8 text.")
    return text


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
    pairs = parse_settings(args.backend_option, "--backend-option", "autocast_dtype=bfloat16")
    out: dict[str, dict[str, Any]] = {role: {} for role in roles}
    # "auto" (the runtime's default) is known only once the model loads, so it declares no options here
    declared = {role: [] if name == AUTO else REGISTRIES[role + "s"].get(name).option_names()
                for role, name in roles.items()}
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
        if name == AUTO:
            if out[role]:
                raise CartridgeError(f"--backend-option {', '.join(sorted(out[role]))} needs a {role} by name: "
                                     f"--{role} auto (the default) picks one once the model loads; give --{role} NAME "
                                     f"(`cartridges backends` lists them).")
            continue
        REGISTRIES[role + "s"].get(name).parse_options(out[role], f"{role} {name!r}")
    return out


def read_corpus(args: argparse.Namespace):
    paths = [Path(p) for p in args.corpus]
    if len(paths) == 1 and paths[0].is_dir():
        return Corpus.from_directory(paths[0], include=args.include, exclude=args.exclude, description=args.description)
    return Corpus.from_files([str(p) for p in paths], description=args.description)


def as_ranks(args: argparse.Namespace, option: str, count: int) -> int | None:
    """With `count` > 1 outside torchrun: run this command again as `count` torchrun ranks on this machine (without
    `option`, which asked for them) and return their exit code. Otherwise None: go on in this process."""
    from ..making.distributed import launch, under_torchrun

    if count <= 1 or under_torchrun():
        return None
    return launch(["cartridges_sdk.cli", *without_option(args.argv, option)], count)


def without_option(argv: list[str], name: str) -> list[str]:
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
