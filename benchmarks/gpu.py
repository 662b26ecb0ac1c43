"""On a GPU: exactness of the HF runtime on CUDA, serving cartridges against ICL at the largest batch that fits, and
self-study's speed against the hardware, in one run of a few minutes (docs/gpu.md has the figures).

    python -m benchmarks.gpu prepare .gpu       # here, once, with the project set up: tokenizer + a document
    python -m benchmarks.gpu run --assets .gpu  # there: scripts/gpu-bench.sh does both halves' installs

The weights are random: no model file fits what reaches the GPU machine (a 64 MiB working tree, no network), and
speed depends on the shapes alone. The serving model has Llama-3.1-8B's shape (32 layers, 8 KV heads of 128, so the
same 128 KiB of KV per token as the paper's model) with the embedded model's 49,152-token vocabulary. Exactness runs
on the tiny random models the unit tests use, which need no files either.

Serving follows the paper's measurement (its appendix, "Throughput measurement details"): for a cache of k tokens,
the largest batch whose KV fits the budget, random cartridges of k tokens, and the time to decode a fixed number of
tokens for every row, here through the HF runtime's own decode loop. ICL of a k-token document decodes exactly as a
k-token cartridge does (the exactness property), so the ICL rows are the same measurement at the document's length;
what ICL pays on top, the document's prefill for every request, is timed on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from cartridges_sdk import Cartridge, GenerationParams, load_model
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.lm import LM

from . import provenance
from .measure import timed

# the serving model's shapes; "tiny" lets the tests run every part on a CPU in seconds
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072),
    # Qwen2.5-0.5B's shape (the reader of docs/self-study.md), as a Llama with biased q/k/v projections
    "qwen-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, rope_theta=1000000.0, max_position_embeddings=32768, attention_bias=True,
                      vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=8192),
}
# docs/self-study.md's recipe for Qwen2.5-Coder-0.5B on a CPU (part "recipe")
RECIPE_0_5B = dict(num_tokens=256, num_conversations=16, document_windows=96, lr=0.01, seed=0)
PAPER_THROUGHPUT_RATIO = 26.4  # the paper's peak-throughput gain over ICL (SGLang, Llama 8B, one H100)
NO_GPU = "benchmarks.gpu: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine (scripts/gpu-bench.sh)."


def log(message: str) -> None:
    print(message, flush=True)


def register_builtins() -> None:
    """Run from a source tree that pip never installed (the GPU machine), the built-in backends have no entry
    points: name them here, as an installed package would."""
    from cartridges_sdk.plugins import runtimes, synthesizers, trainers

    for registry, name, target in ((runtimes, "hf", "cartridges_sdk.hf:HFRuntime"),
                                   (synthesizers, "hf", "cartridges_sdk.hf:HFSynthesizer"),
                                   (trainers, "torch", "cartridges_sdk.making.training:TorchTrainer")):
        if name not in registry.names():
            log(f"registering the built-in {registry.kind} {name!r} ({target}): cartridges-sdk is not pip-installed here")
            registry.register(name, target)


# -- the model ---------------------------------------------------------------------------------------------------
def random_lm(shape: str, tokenizer: Any, device: str, dtype: torch.dtype, seed: int = 0) -> LM:
    """A Llama of `shape` with random weights, built on `device` in `dtype` (no file, no float32 detour)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape not in SHAPES:
        raise SystemExit(f"benchmarks.gpu: --shape {shape!r} is not one of {sorted(SHAPES)}.")
    config = LlamaConfig(**{"vocab_size": len(tokenizer), "tie_word_embeddings": False, **SHAPES[shape]},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    model.to(device)  # transformers may build on the CPU whatever the default device
    model.config._name_or_path = f"random-{shape}"
    return load_model(model.eval(), tokenizer, device=device)


def tokenizer_of(assets: Path | None, shape: str) -> Any:
    if assets is None:
        if shape != "tiny":
            raise SystemExit("benchmarks.gpu: --assets DIR is needed for a real shape (`python -m benchmarks.gpu "
                             "prepare DIR` writes it where the project is set up).")
        from cartridges_sdk.testing import CHATML, char_tokenizer

        return char_tokenizer(bos=False, chat_template=CHATML)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets / "tokenizer")


def document_of(assets: Path | None) -> str:
    if assets is None:
        from cartridges_sdk.testing import CONTRACT_TEXTS

        return "\n\n".join(CONTRACT_TEXTS) * 40
    return (assets / "document.txt").read_text(encoding="utf-8")


# -- part 1: exactness -------------------------------------------------------------------------------------------
def exactness(device: str) -> dict[str, Any]:
    """The runtime contract on `device` in float32 (its strict tolerance), then bfloat16 measured against the
    float32 forward: a cartridge must be no further from it than the text in context is in bfloat16."""
    from cartridges_sdk import testing
    from cartridges_sdk.hf import HFRuntime

    out: dict[str, Any] = {"device": device, "fp32_contract": {}, "bf16": {}}
    for kind in ("llama", "qwen2"):
        lm = testing.tiny_lm(kind)
        lm.model.to(device)
        runtime = HFRuntime(lm)
        try:
            testing.check_runtime(runtime, lm)
            out["fp32_contract"][kind] = "passed"
        except AssertionError as err:
            out["fp32_contract"][kind] = f"FAILED: {err}"
        finally:
            runtime.close()
        ids = lm.encode(testing.CONTRACT_TEXTS[0] + " " + testing.CONTRACT_TEXTS[1])
        reference = {p: lm.logits(ids).log_softmax(-1)[p:] for p in (8, 24, 64)}  # float32, text in context
        lm.model.to(torch.bfloat16)
        rows = []
        for p, ref in reference.items():
            cartridge = Cartridge.from_prefix(lm, ids[:p], p)
            with_cart = cartridge.logits(ids[p:]).log_softmax(-1)
            in_context = lm.logits(ids).log_softmax(-1)[p:]
            rows.append({"p": p, "cartridge_vs_fp32": float((with_cart - ref).abs().max()),
                         "in_context_vs_fp32": float((in_context - ref).abs().max()),
                         "cartridge_vs_in_context": float((with_cart - in_context).abs().max()),
                         "same_argmax": float((with_cart.argmax(-1) == in_context.argmax(-1)).float().mean())})
            rows[-1]["ok"] = rows[-1]["cartridge_vs_fp32"] <= 2 * rows[-1]["in_context_vs_fp32"] + 1e-3
        out["bf16"][kind] = rows
        lm.close()
    out["passed"] = all(v == "passed" for v in out["fp32_contract"].values()) and all(
        r["ok"] for rows in out["bf16"].values() for r in rows)
    log(f"exactness on {device}: fp32 contract {out['fp32_contract']}; bf16 max |cartridge - fp32| / "
        f"|in context - fp32|: " + ", ".join(f"{k} p={r['p']}: {r['cartridge_vs_fp32']:.3f}/{r['in_context_vs_fp32']:.3f}"
                                             for k, rows in out["bf16"].items() for r in rows))
    return out


# -- part 2: serving ---------------------------------------------------------------------------------------------
def random_cartridge(lm: LM, tokens: int, seed: int) -> Cartridge:
    """A cartridge of `tokens` random vectors made on the model's device (speed does not depend on what it holds)."""
    from cartridges_sdk.kit import CartridgeMeta

    gen = torch.Generator(device=lm.device).manual_seed(seed)
    shape = (lm.num_kv_heads, tokens, lm.head_dim)
    keys = [torch.randn(shape, generator=gen, device=lm.device, dtype=lm.dtype) for _ in range(lm.num_layers)]
    values = [torch.randn(shape, generator=gen, device=lm.device, dtype=lm.dtype) for _ in range(lm.num_layers)]
    meta = CartridgeMeta(model=lm.identity, num_tokens=tokens, init="random", dtype=str(lm.dtype).removeprefix("torch."))
    return Cartridge(keys, values, meta, lm=lm)


# the two ways the runtime can run one decoding token's attention on CUDA (kv.MATMUL_DECODE_MIN_KEYS picks by length)
DECODE_PATHS = {"sdpa": 10**12, "matmul": 0}


@contextlib.contextmanager
def decode_path(name: str):
    """Force the runtime's decode attention on CUDA to one path, whatever the key length."""
    from cartridges_sdk import kv

    before = kv.MATMUL_DECODE_MIN_KEYS
    kv.MATMUL_DECODE_MIN_KEYS = DECODE_PATHS[name]
    try:
        yield
    finally:
        kv.MATMUL_DECODE_MIN_KEYS = before


def attention_paths(lm: LM, shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Milliseconds and bandwidth of one decoding token's masked attention in one layer of the model's shape, for
    each (rows, keys): SDPA with ``enable_gqa`` as transformers calls it (SDPA's own choice of kernel: on Hopper,
    cuDNN's, which at one fixed shape plans once), and the runtime's two folded paths under its decoding kernels
    (memory-efficient attention, two batched matrix products), with each one's largest error against float32."""
    from cartridges_sdk.kv import _folded_gqa, decoding_kernels

    dev, dt = lm.device, lm.dtype
    heads = lm.model.config.num_attention_heads
    out = []
    for batch, length in shapes:
        row: dict[str, Any] = {"rows": batch, "keys": length}
        try:
            q = torch.randn(batch, heads, 1, lm.head_dim, device=dev, dtype=dt)
            k, v = (torch.randn(batch, lm.num_kv_heads, length, lm.head_dim, device=dev, dtype=dt) for _ in range(2))
            mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=dev)
            mask[0, ..., : length // 2] = False  # a padded row, as a batch of unequal prefixes has
            kv_bytes = 2 * k.numel() * k.element_size()
            reference = torch.nn.functional.scaled_dot_product_attention(
                q[:1].float(), k[:1].float(), v[:1].float(), attn_mask=mask[:1], enable_gqa=True).transpose(1, 2)

            def folded(name):
                def call():
                    with decode_path(name), decoding_kernels(dev):  # the kernels the runtime's decoding may use
                        return _folded_gqa(q, k, v, mask, 0.0, None)[0]
                return call

            calls = {"enable_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(
                         q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2),
                     "folded_sdpa": folded("sdpa"), "folded_matmul": folded("matmul")}
            for name, call in calls.items():
                try:
                    first = call()
                    row[f"{name}_error"] = float((first[:1].float() - reference).abs().max())
                    _, seconds = timed(dev, lambda: [call() for _ in range(5)])
                    row[f"{name}_ms"] = 1000 * seconds / 5
                    row[f"{name}_tb_per_s"] = kv_bytes / (seconds / 5) / 1e12
                except torch.OutOfMemoryError:
                    row[f"{name}_ms"] = None
            del q, k, v, mask, reference
        except torch.OutOfMemoryError as err:
            row["error"] = f"out of memory: {str(err).splitlines()[0]}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        out.append(row)
        log(f"attention: {json.dumps(row)}")
    return out


def serve_batch(lm: LM, cartridges: list[Cartridge], prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Decode `new_tokens` for every row (row i after ``cartridges[i % len]``, then its prompt) through the HF
    runtime's decode loop, end-of-turn ignored so every row decodes the same count. Returns (tokens, seconds)."""
    from cartridges_sdk.hf.decode import decode
    from cartridges_sdk.kv import concat_layers

    installed = [concat_layers(lm, [c]) for c in cartridges]  # what the runtime installs, once per cartridge
    prefixes = [installed[i % len(installed)] for i in range(len(prompts))]
    params = GenerationParams(max_new_tokens=new_tokens, temperature=0.0)

    def run() -> int:
        for state in decode(lm, prefixes, prompts, params, stop_ids=()):
            pass
        return sum(len(t) for t in state.tokens)

    return timed(lm.device, run)


def cudnn_check(lm: LM, tokens: int = 2048, batch: int = 64, new_tokens: int = 32) -> dict[str, Any]:
    """Decode tokens/s of one batch with cuDNN's attention kept out (`kv.decoding_kernels`, the runtime's default on
    CUDA) and allowed, as SDPA would choose by itself: cuDNN builds a plan per shape, and a decode's key length
    changes every step."""
    prompt = lm.prompt_ids([{"role": "user", "content": "What is it about?"}], after_cartridge=True)
    pool = [random_cartridge(lm, tokens, 0)]
    out: dict[str, Any] = {"cache_tokens": tokens, "batch": batch, "new_tokens": new_tokens}
    from cartridges_sdk.hf import decode as decode_module

    for allowed in (False, True):
        kernels = decode_module.decoding_kernels
        if allowed:  # what decoding did before it kept cuDNN out: SDPA's own choice
            decode_module.decoding_kernels = lambda device: contextlib.nullcontext()
        try:
            serve_batch(lm, pool, [prompt] * batch, 4)
            made, seconds = serve_batch(lm, pool, [prompt] * batch, new_tokens)
            out[f"tokens_per_s_cudnn_{'allowed' if allowed else 'kept_out'}"] = made / seconds
        finally:
            decode_module.decoding_kernels = kernels
    log(f"cuDNN attention: {json.dumps(out)}")
    return out


def default_budget_gib(lm: LM) -> float:
    """The KV budget every cache size shares: what the device has free, less room for one document-sized
    cartridge of the pool (17 GiB at 128k tokens of this shape) and the step's activations."""
    free = torch.cuda.mem_get_info(lm.device)[0] / 2**30
    return round(min(0.6 * free, free - 26), 1)


def serving(lm: LM, sizes: list[int], document_sizes: set[int], budget_gib: float | None, new_tokens: int,
            repeats: int, max_batch: int) -> dict[str, Any]:
    """Decode tokens/s at the largest batch whose KV fits `budget_gib`, for caches of each size."""
    from .measure import kv_bytes_per_token

    extra: dict[str, Any] = {}
    if lm.device.type == "cuda":
        extra["cudnn"] = cudnn_check(lm)
        torch.cuda.empty_cache()
    if budget_gib is None:
        if lm.device.type != "cuda":
            raise SystemExit("benchmarks.gpu: pass --budget-gib off a GPU (on one it defaults to its free memory).")
        budget_gib = default_budget_gib(lm)
    log(f"KV budget: {budget_gib} GiB")
    per_token = kv_bytes_per_token(lm)
    budget = int(budget_gib * 2**30)
    questions = ["What does the document say about its main result?", "Who wrote it, and when?",
                 "Summarize the second section.", "Which methods does it compare?"]
    prompts = [lm.prompt_ids([{"role": "user", "content": q}], after_cartridge=True) for q in questions]
    width = max(len(p) for p in prompts)
    rows = []
    for k in sizes:
        per_user = (k + width + new_tokens) * per_token
        batch = min(budget // per_user, max_batch)
        row: dict[str, Any] = {"cache_tokens": k, "kind": "ICL" if k in document_sizes else "cartridge",
                               "kv_bytes_per_user": per_user, "batch": int(batch)}
        if batch < 1:
            row["error"] = f"one user's KV ({per_user / 2**30:.1f} GiB) exceeds the {budget_gib} GiB budget"
            rows.append(row)
            log(json.dumps(row))
            continue
        try:
            pool = [random_cartridge(lm, k, seed) for seed in range(min(batch, 4 if per_user < 2**30 else 1))]
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            paths = list(DECODE_PATHS) if lm.device.type == "cuda" else ["sdpa"]  # the folds are CUDA's alone
            by_path = {}
            for path in paths:
                with decode_path(path):
                    serve_batch(lm, pool, batch_prompts, 4)  # warm-up: kernels chosen, allocator grown
                    runs = [serve_batch(lm, pool, batch_prompts, new_tokens) for _ in range(repeats)]
                tokens, seconds = [t for t, _ in runs], [s for _, s in runs]
                by_path[path] = {"tokens_per_s": sum(tokens) / sum(seconds), "seconds": [round(s, 3) for s in seconds],
                                 "step_ms": 1000 * sum(seconds) / (repeats * new_tokens)}  # the prompt's step too
            best = max(by_path, key=lambda p: by_path[p]["tokens_per_s"])
            row.update(by_path[best], path=best, paths=by_path, new_tokens=tokens[0], distinct_cartridges=len(pool))
            if lm.device.type == "cuda":
                row["peak_gpu_gib"] = torch.cuda.max_memory_allocated(lm.device) / 2**30
            del pool
        except torch.OutOfMemoryError as err:
            row["error"] = f"out of memory: {str(err).splitlines()[0]}"
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
        if k in document_sizes:  # what ICL pays per request besides decoding: the document's prefill
            ids = torch.randint(0, len(lm.tokenizer), (k,)).tolist()
            try:
                _, row["prefill_s"] = timed(lm.device, lambda: lm.kv(ids))
            except torch.OutOfMemoryError as err:
                row["prefill_error"] = f"out of memory: {str(err).splitlines()[0]}"
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(lm.device)
        rows.append(row)
        log(json.dumps(row))
    # requests/s: a batch of answers takes its decode time; ICL also prefills each request's document first
    for row in rows:
        if "tokens_per_s" in row:
            decode_s = sum(row["seconds"]) / len(row["seconds"])
            if row["kind"] == "cartridge" or "prefill_s" in row:
                row["requests_per_s"] = row["batch"] / (decode_s + row["batch"] * row.get("prefill_s", 0.0))
    ratios = {}
    for c in (r for r in rows if r["kind"] == "cartridge" and "tokens_per_s" in r):
        for d in (r for r in rows if r["kind"] == "ICL" and "tokens_per_s" in r):
            ratios[f"cartridge {c['cache_tokens']} vs ICL {d['cache_tokens']}"] = {
                "tokens_per_s": c["tokens_per_s"] / d["tokens_per_s"],
                "requests_per_s": c["requests_per_s"] / d["requests_per_s"] if "requests_per_s" in d else None}
    shapes = [(r["batch"], r["cache_tokens"]) for r in rows if r["batch"] >= 1]
    return {**extra, "attention": attention_paths(lm, shapes), "budget_gib": budget_gib, "kv_bytes_per_token": per_token, "new_tokens": new_tokens, "repeats": repeats,
            "rows": rows, "ratios": ratios, "paper_ratio": PAPER_THROUGHPUT_RATIO}


def profile_decode(lm: LM, shapes: list[tuple[int, int]], new_tokens: int, out_dir: Path) -> dict[str, Any]:
    """Where a decode call's time goes, for each (cache tokens, rows): the profiler's top operators by device and by
    host time, written as text next to the results."""
    from torch.profiler import ProfilerActivity, profile

    prompt = lm.prompt_ids([{"role": "user", "content": "What is it about?"}], after_cartridge=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if lm.device.type == "cuda" else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {}
    for tokens, batch in shapes:
        pool = [random_cartridge(lm, tokens, 0)]
        serve_batch(lm, pool, [prompt] * batch, 2)  # warm-up
        with profile(activities=activities) as prof:
            made, seconds = serve_batch(lm, pool, [prompt] * batch, new_tokens)
        averages = prof.key_averages()
        tables = []
        for key in ("device_time_total", "cuda_time_total", "cpu_time_total"):
            try:
                tables.append(f"sorted by {key}\n" + averages.table(sort_by=key, row_limit=30, max_name_column_width=70))
            except (AttributeError, KeyError, ValueError, RuntimeError) as err:
                tables.append(f"sorted by {key}: {err}")
        name = f"profile-{tokens}x{batch}.txt"
        (out_dir / name).write_text(f"{batch} rows after {tokens} cache tokens, {new_tokens} new tokens: "
                                    f"{seconds:.3f} s profiled\n\n" + "\n\n".join(tables))
        result[f"{tokens}x{batch}"] = {"file": name, "seconds": seconds, "tokens": made}
        log(f"profiled {batch} rows x {tokens:,} cache tokens: {seconds:.2f} s for {new_tokens} tokens -> {name}")
        del pool
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# -- part 3: self-study ------------------------------------------------------------------------------------------
def training_speed(lm: LM, text: str, tokens: int, windows: int, batch_tokens: list[int], peak: float) -> dict[str, Any]:
    """Training's useful FLOP/s against the matmul peak, for each micro-batch size: small micro-batches leave a GPU
    waiting on the host's kernel launches. Timed is the step loop alone (the trainer's own clock), without the final
    checkpoint (no output folder) or the copy of the result to the host."""
    from cartridges_sdk.plugins import trainers
    from cartridges_sdk.trainer_inputs import TrainConfig

    from . import methods

    device = lm.device
    ids = methods.document_ids(lm, text)
    chunks = methods.raw_windows(ids, windows, seed=0)
    start_cart = Cartridge.from_prefix(lm, ids, min(tokens, len(ids)))
    flops = methods.training_flops(lm, chunks, start_cart.num_tokens, 1)
    train_tokens = sum(c.num_tokens for c in chunks)
    out: dict[str, Any] = {"tokens": train_tokens, "cartridge_tokens": start_cart.num_tokens, "windows": len(chunks),
                           "runs": []}
    for bt in batch_tokens:
        config = TrainConfig(objective="ntp", eval_fraction=0.0, checkpoint_every=10**6, checkpoint_seconds=1e9,
                             batch_tokens=bt)
        trainer = trainers.create("torch", lm)
        try:
            per_batch = max(1, bt // max(c.num_tokens for c in chunks))
            trainer.fit(start_cart, chunks[:per_batch], lm, config, progress=False)  # warm-up at this batch's shapes
            trainer = trainers.create("torch", lm)  # a history of the timed run alone
            _, wall = timed(device, lambda: trainer.fit(start_cart, chunks, lm, config, progress=False))
            loop = trainer.history[-1]["elapsed_s"]
            row = {"batch_tokens": bt, "steps": len(trainer.history), "seconds": loop, "wall_seconds": wall,
                   "tokens_per_s": train_tokens / loop, "useful_flops_per_s": flops / loop, "mfu": flops / loop / peak,
                   "peak_memory_mb": trainer.history[-1].get("peak_memory_mb")}
            log(f"training, batch_tokens={bt}: {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.2f} "
                f"({row['steps']} steps in {loop:.2f} s; {wall:.2f} s with setup and the copy out; "
                f"peak {row['peak_memory_mb'] or 0:,.0f} MB)")
        except torch.OutOfMemoryError as err:
            row = {"batch_tokens": bt, "error": f"out of memory: {err}"[:300]}
            log(f"training, batch_tokens={bt}: out of memory")
        out["runs"].append(row)
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    done = [r for r in out["runs"] if "mfu" in r]
    if done:
        out.update(max(done, key=lambda r: r["mfu"]))
    return out


@contextlib.contextmanager
def rows_one_by_one():
    """The synthesizer as it was before `PackedRows`: each row's KV concatenated and written into the batch cache
    on its own (two copies per row and layer), to measure what the packed layout saves."""
    from cartridges_sdk.hf import synthesizer as module

    packed = module.prefill_rows

    def one_by_one(lm, prefix, prompts):
        rows = packed(lm, prefix, prompts)
        return [rows.row(i) for i in range(len(rows))] if hasattr(rows, "row") else rows

    module.prefill_rows = one_by_one
    try:
        yield
    finally:
        module.prefill_rows = packed


def synthesis_speed(lm: LM, text: str, conversations: int, per_chunk: list[int]) -> dict[str, Any]:
    """Synthesis tokens/s against the raw batched decode of the same model where synthesis decodes (as
    benchmarks.efficiency does on a CPU), with rows packed (now) and one by one (before)."""
    from cartridges_sdk.making.settings import SynthesisConfig
    from cartridges_sdk.making.synthesis import synthesize
    from cartridges_sdk.plugins import synthesizers

    from . import methods
    from .measure import synthesis_yardstick

    device = lm.device
    ids = methods.document_ids(lm, text)
    runs = []
    for chunk in per_chunk:
        config = SynthesisConfig(num_conversations=conversations, conversations_per_chunk=chunk, document_windows=0,
                                 seed=0)
        raw = synthesis_yardstick(lm, ids, config)
        for layout in ("packed", "one_by_one"):
            with rows_one_by_one() if layout == "one_by_one" else contextlib.nullcontext():
                with tempfile.TemporaryDirectory() as tmp:
                    ds, seconds = timed(device, lambda: synthesize(text, lm, Path(tmp) / "data", config,
                                                                   synthesizer=synthesizers.create("hf", lm),
                                                                   progress=False))
                    generated = methods.generated_tokens(lm, list(ds))  # read before its folder goes
            row = {"per_chunk": chunk, "layout": layout, "conversations": conversations, "generated_tokens": generated,
                   "seconds": seconds, "tokens_per_s": generated / seconds, "raw_decode_tokens_per_s": raw,
                   "ratio": generated / seconds / raw}
            log(f"synthesis, {chunk} per chunk, rows {layout}: {row['tokens_per_s']:,.0f} tokens/s = {row['ratio']:.2f} "
                f"of raw batched decode ({raw:,.0f} tokens/s)")
            runs.append(row)
    best = max((r for r in runs if r["layout"] == "packed"), key=lambda r: r["ratio"])
    return {"runs": runs, **best}


def selfstudy(lm: LM, text: str, tokens: int, windows: int, conversations: int, per_chunk: list[int],
              batch_tokens: list[int]) -> dict[str, Any]:
    """Training's MFU and synthesis against raw decode, the two figures docs/gpu.md tracks."""
    from .measure import matmul_peak

    device = lm.device
    n = 8192 if device.type == "cuda" else 512
    peak = matmul_peak(lm.dtype, n=n, device=device)
    log(f"self-study: {lm.dtype} matmul peak {peak / 1e12:.1f} TFLOP/s ({n}^3)")
    return {"matmul_peak_flops": peak, "matmul_n": n,
            "training": training_speed(lm, text, tokens, windows, batch_tokens, peak),
            "synthesis": synthesis_speed(lm, text, conversations, per_chunk)}


def recipe(lm: LM, text: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A whole `from_corpus` build with docs/self-study.md's recipe for the 0.5B reader: the seconds a user waits,
    and the training loop's share. Random weights never end a message early, so synthesis here is its longest."""
    from cartridges_sdk.making.training import RUN_LOG

    device = lm.device
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "build"
        cart, seconds = timed(device, lambda: Cartridge.from_corpus(text, lm, output_dir=work, **settings))
        logged = [json.loads(line) for p in work.rglob(RUN_LOG) for line in p.read_text().splitlines() if line]
    train_s = max((r["elapsed_s"] for r in logged if "elapsed_s" in r), default=None)
    out = {"settings": settings, "seconds": seconds, "training_seconds": train_s,
           "corpus_tokens": len(lm.encode(text)), "work_dtype": (cart.meta.training or {}).get("work_dtype")}
    log(f"recipe {settings}: {seconds:.1f} s in all, training {train_s or 0:.1f} s")
    return out


# -- the commands ------------------------------------------------------------------------------------------------
def prepare(folder: Path, data: Path, doc: int) -> None:
    """What the GPU machine cannot fetch: the embedded model's tokenizer and one real document."""
    lm = load_model()
    folder.mkdir(parents=True, exist_ok=True)
    lm.tokenizer.save_pretrained(folder / "tokenizer")
    text = json.loads(data.read_text(encoding="utf-8").splitlines()[doc])["input"]
    (folder / "document.txt").write_text(text, encoding="utf-8")
    log(f"wrote {folder}/tokenizer and {folder}/document.txt ({len(lm.encode(text)):,} tokens, document {doc} of {data})")


def run(args: argparse.Namespace) -> int:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    register_builtins()
    dtype = getattr(torch, args.dtype)
    result: dict[str, Any] = {"commit": provenance.commit(), "dirty": provenance.dirty(),
                              "machine": provenance.machine(), "shape": args.shape, "dtype": args.dtype,
                              "weights": "random"}
    if device == "cuda":
        result["cudnn_sdp_default"] = torch.backends.cuda.cudnn_sdp_enabled()
        result["gpu"] = torch.cuda.get_device_name(0)
        result["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    parts = args.parts.split(",")
    out = args.out

    def save() -> None:
        atomic_write_json(out, result)

    for part in parts:
        try:
            if part == "exactness":
                result["exactness"] = exactness(device)
            elif part in ("serving", "selfstudy", "profile", "recipe"):
                if "lm" not in locals():
                    tok = tokenizer_of(args.assets, args.shape)
                    (lm, build_s) = timed(torch.device(device), lambda: random_lm(args.shape, tok, device, dtype))
                    log(f"built a random {args.shape} ({lm.num_parameters / 1e9:.2f}B "
                        f"parameters, {args.dtype}) on {device} in {build_s:.1f} s")
                if part == "profile":
                    shapes = [tuple(int(x) for x in pair.split("x")) for pair in args.profile.split(",")]
                    result["profile"] = profile_decode(lm, shapes, args.new_tokens, out.parent)
                elif part == "serving":
                    sizes = [int(s) for s in args.cartridges.split(",")] + [int(s) for s in args.documents.split(",")]
                    result["serving"] = serving(lm, sizes, {int(s) for s in args.documents.split(",")}, args.budget_gib,
                                                args.new_tokens, args.repeats, args.max_batch)
                elif part == "selfstudy":
                    result["selfstudy"] = selfstudy(lm, document_of(args.assets), args.train_tokens, args.windows,
                                                    args.conversations, ints(args.per_chunk), ints(args.batch_tokens))
                else:
                    result["recipe"] = recipe(lm, document_of(args.assets), RECIPE_0_5B)
            else:
                raise SystemExit(f"benchmarks.gpu: unknown part {part!r}; parts are exactness, serving, selfstudy, "
                                 "recipe, profile.")
        except SystemExit:
            raise
        except Exception as err:  # noqa: BLE001 - one part failing must not lose the others' figures
            result[part] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            log(f"{part} FAILED: {type(err).__name__}: {err}")
        save()
    log(f"wrote {out}")
    print_table(result)
    return 0 if all("error" not in result.get(p, {}) for p in parts) else 1


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def print_table(result: dict[str, Any]) -> None:
    serving_result = result.get("serving", {})
    if serving_result.get("rows"):
        log("\n| cache (tokens) | kind | batch | decode tokens/s | step ms | attention | requests/s |\n"
            "|---|---|---|---|---|---|---|")
        for r in serving_result["rows"]:
            if "tokens_per_s" in r:
                log(f"| {r['cache_tokens']:,} | {r['kind']} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
                    f"{r['step_ms']:.1f} | {r['path']} | {r.get('requests_per_s', 0):.2f} |")
            else:
                log(f"| {r['cache_tokens']:,} | {r['kind']} | {r['batch']} | {r.get('error')} | | | |")
        for name, ratio in serving_result["ratios"].items():
            requests = ratio["requests_per_s"]
            log(f"{name}: {ratio['tokens_per_s']:.1f}x decode tokens/s, "
                + (f"{requests:.1f}x requests/s" if requests else "requests/s not measured")
                + f" (paper: {PAPER_THROUGHPUT_RATIO}x decode tokens/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the tokenizer and a document the GPU machine needs")
    prep.add_argument("folder", type=Path)
    from .data import DEFAULT_DATA

    prep.add_argument("--data", type=Path, default=DEFAULT_DATA)
    prep.add_argument("--doc", type=int, default=3)
    go = sub.add_parser("run", help="measure (needs a CUDA GPU unless --device cpu)")
    go.add_argument("--assets", type=Path, help="the folder `prepare` wrote (else: tiny shape, built-in texts)")
    go.add_argument("--device", default="cuda")
    go.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    go.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    go.add_argument("--parts", default="exactness,serving,selfstudy,recipe")
    go.add_argument("--cartridges", default="512,2048", help="cartridge sizes p")
    go.add_argument("--documents", default="8192,32768,131072", help="ICL document lengths")
    go.add_argument("--budget-gib", type=float, help="KV budget every cache size shares (default: from free memory)")
    go.add_argument("--max-batch", type=int, default=1024)
    go.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per row (the paper: 128)")
    go.add_argument("--repeats", type=int, default=2, help="timed runs per size, after one short warm-up")
    go.add_argument("--train-tokens", type=int, default=2048, help="cartridge size trained (the paper's 2048)")
    go.add_argument("--windows", type=int, default=128, help="256-token windows trained on")
    go.add_argument("--conversations", type=int, default=128)
    go.add_argument("--per-chunk", default="64", help="conversations decoded together per chunk (comma-separated)")
    go.add_argument("--batch-tokens", default="2048,8192,16384",
                    help="training micro-batch sizes to measure (comma-separated; the default setting is 2048)")
    go.add_argument("--profile", default="131072x4,8192x73,512x904",
                    help="part 'profile': comma-separated CACHExROWS decode calls to profile")
    go.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.folder, args.data, args.doc)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
