"""Atomic file writes: every file the SDK writes is whole or absent, never half-written."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigError


def atomic_write(path: str | os.PathLike, write: Callable[[str], object], *, mode: int | None = None) -> Path:
    """Call `write(tmp)` on a temporary file beside `path`, flush it to disk, then rename it over `path`.

    A crash or an exception leaves the previous file (or none) and no temporary file behind. The file gets the
    permissions the umask gives new files (others sharing a store can read it), or `mode` (0o600: the owner's only,
    from its first byte); the rename itself is made durable by syncing the folder.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{str(path)!r} is a folder; give a file path (e.g. {str(path / 'out.safetensors')!r}).")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)  # mkstemp makes files private (0600)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some systems cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, *, name: str = ".lock", timeout: float = 0, busy: str | None = None,
                error: type[ConfigError] = ConfigError) -> Iterator[None]:
    """Hold `folder` for this process; a second process on the same folder fails (after `timeout` seconds of
    waiting; a negative one waits for ever) instead of mixing its work in. The lock is the operating system's, so it
    is released even when the holder is killed. `busy` and `error` replace the refusal's message and class."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / name), timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise error(busy or (
            f"{str(folder)!r} is in use by another process (two runs on one folder would mix their work); wait for "
            "it to finish, or use another folder."
        )) from None
    try:
        yield
    finally:
        lock.release()


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """`data` as indented JSON, written atomically."""
    text = json.dumps(data, indent=2)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))
