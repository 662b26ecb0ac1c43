"""llama.cpp runtime against HF on one model: is a cartridge exact inside llama.cpp, and how close to HF is it?

For each p: a cartridge of llama.cpp's own prefill must answer bit for bit as the text in context; an HF prefix
cartridge served by llama.cpp is compared with HF over a question and a teacher-forced answer (KL(HF || llama.cpp)
per position), beside the same cartridge with its keys in the wrong RoPE pairing (what a layout mistake would cost).
For models the tests do not cover (e.g. Qwen2 GGUFs):

    python -m benchmarks.llamacpp_check --model "$(scripts/get-qwen.sh)" [--sizes 16,64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cartridges_sdk import Cartridge, GenerationParams, GenerationRequest, load_model, testing
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.rope import INTERLEAVED, ROTATE_HALF, convert_pairing

from . import provenance

QUESTION = [{"role": "user", "content": "Who built the lighthouse, and when?"}]
ANSWER = " It was built in 1871 by Margaret Ellison."


def kl(hf: np.ndarray, served: np.ndarray) -> np.ndarray:
    return (np.exp(hf) * (hf - served)).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf (default: the embedded default model)")
    parser.add_argument("--sizes", default="16,64")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp_check.json"))
    args = parser.parse_args()

    lm = load_model(args.model) if args.model else load_model()
    runtime = lm.get_runtime("llamacpp", **({"gguf": args.model} if args.model else {}))
    ids = lm.encode(" ".join(testing.CONTRACT_TEXTS))
    prompt = lm.prompt_ids(QUESTION, after_cartridge=True)
    seq = prompt + lm.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    params = GenerationParams(max_new_tokens=16, top_logprobs=5)
    rows = []
    for p in (int(s) for s in args.sizes.split(",")):
        own = runtime.prefill(ids[:p])
        cart, text = runtime.generate([GenerationRequest(QUESTION, [own], params),
                                       GenerationRequest(QUESTION, [], params, prefix_ids=ids[:p])])
        c = Cartridge.from_prefix(lm, ids[:p], p)
        swapped = Cartridge([convert_pairing(k, ROTATE_HALF, INTERLEAVED) for k in c.keys], c.values, c.meta, lm=lm)
        hf = lm.logits(seq, cartridges=[c])[len(prompt) - 1 : -1].double().log_softmax(-1).numpy()
        right = kl(hf, runtime.next_token_logprobs([c], seq)[len(prompt) - 1 : -1])
        wrong = kl(hf, runtime.next_token_logprobs([swapped], seq)[len(prompt) - 1 : -1])
        rows.append({
            "p": p, "blob_equals_llamacpps": runtime.state_blob(own) == runtime.state_of(ids[:p]),
            "own_prefill_equals_text": cart.token_ids == text.token_ids
            and bool(np.array_equal(cart.top_logprobs, text.top_logprobs)),
            "kl_mean": round(float(right.mean()), 5), "kl_max": round(float(right.max()), 5),
            "kl_swapped_pairing_mean": round(float(wrong.mean()), 3), "kl_swapped_pairing_max": round(float(wrong.max()), 3),
            "answer": cart.text,
        })
        print(json.dumps(rows[-1]), flush=True)
    atomic_write_json(args.out, {"model": lm.name, "gguf": str(runtime.gguf), "architecture": runtime.arch,
                                 "pairing": runtime.pairing, "rows": rows, "commit": provenance.commit(),
                                 "dirty": provenance.dirty(), "machine": provenance.machine()})
    lm.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
