"""One user never hurts another: hostile and careless input against a real `cartridges serve` app on 127.0.0.1, a
store with hostile files, crafted cartridge metadata, and the CLI that reads them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cartridges_sdk import Cartridge, CartridgeStore, ConfigError, IncompatibleCartridgeError, ModelIdentity
from cartridges_sdk.cartridge import CartridgeMeta
from cartridges_sdk.cli import main as cli
from cartridges_sdk.errors import CartridgeFormatError
from cartridges_sdk.hf import HFRuntime
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import ServeConfig
from cartridges_sdk import testing
from cartridges_sdk.testing import serving

KEY = "sk-hostile"
TEXTS = [f"Keeper {n} of the lighthouse number {i} logged {w} storms in the winter of 18{i}{n}."
         for i, (n, w) in enumerate(zip("ABCDEFGH", ("three", "five", "nine", "two", "six", "one", "four", "ten")))]


def rewrite_meta(path: Path, change) -> Path:
    """Rewrite a cartridge file's JSON metadata in place with `change(meta_dict)`, as an attacker with a hex editor
    would: the tensors stay as they were."""
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    meta = json.loads(header["meta"])
    change(meta)
    save_file(tensors, str(path), metadata={**header, "meta": json.dumps(meta)})
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama):
    store = CartridgeStore(tmp_path_factory.mktemp("store"), tiny_llama)
    for i, text in enumerate(TEXTS):
        store.add(f"c{i}", Cartridge.from_prefix(tiny_llama, text, 8 + i), corpus=text)
    return store


@pytest.fixture(scope="module")
def served(store, tiny_llama):
    app = create_app(store, tiny_llama.get_runtime("hf"), ServeConfig(api_key=KEY))
    with serving(app) as url:
        yield url, app


def post(url: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    headers |= kw.pop("headers", {})
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}/chat/completions", content=content, headers=headers, timeout=120, **kw)


def body(model: str, question: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
            **extra}


def answer_of(url: str, job: dict) -> tuple[int, str]:
    """(status, answer text or error message) of a request with the key, streamed or not (a stream must end with
    [DONE], failed ones too)."""
    return testing.chat_answer(url, job, {"authorization": f"Bearer {KEY}"})


# ---- case 1: one request never fails the others

def test_a_seed_out_of_range_is_a_400_and_fails_no_one_else(store, tiny_llama):
    poison = body("c3", "q", max_tokens=4, temperature=1, seed=18446744073709551616)
    testing.check_one_request_fails_alone(tiny_llama.get_runtime("hf"), store, store.names(), poison=poison)


@pytest.mark.parametrize("runtime", ["hf", "example"])  # the continuous path, and the batch-by-batch one
def test_a_request_that_breaks_the_engine_fails_alone(runtime, store, tiny_llama):
    testing.check_one_request_fails_alone(tiny_llama.get_runtime(runtime), store, store.names())


# ---- case 2: a cartridge for another model never gets in

def test_a_cartridge_for_another_model_is_refused_even_without_its_identity(tmp_path, store, served, tiny_llama):
    url, _ = served
    # made for a model with other shapes (2 layers, 1 kv head, head dim 32); the file then loses its identity
    keys = [torch.randn(1, 8, 32) for _ in range(2)]
    arch = {"model_type": "qwen2", "num_layers": 2, "num_kv_heads": 1, "head_dim": 32}
    alien = Cartridge(keys, [k.clone() for k in keys], CartridgeMeta(ModelIdentity("other", architecture=arch), 8))
    for name, change, why in [
        ("anon", lambda m: m.pop("model"), "does not say which model"),
        ("shapeless", lambda m: m["model"].update(architecture={}, tokenizer=None), "does not say which model"),
        ("typed", lambda m: m["model"].update(architecture={"model_type": "llama"}), "does not say which model"),
        ("other", lambda m: None, "num_layers: 2 vs 3"),
    ]:
        path = rewrite_meta(alien.save(tmp_path / f"{name}.safetensors"), change)
        with pytest.raises(IncompatibleCartridgeError, match=why):
            Cartridge.load(path, model=tiny_llama)
        crafted = Cartridge.load(path)
        with pytest.raises(IncompatibleCartridgeError, match=why):  # every runtime's install checks too
            tiny_llama.get_runtime("hf").generate([_request(crafted)])
        with pytest.raises(IncompatibleCartridgeError, match=why):
            store.add(name, crafted)
        (store.root / path.name).write_bytes(path.read_bytes())  # dropped into the served folder by hand
        code, message = answer_of(url, body(name, "Hi"))
        assert code == 404 and "is left out of the store" in message and why in message, message
        assert str(store.root) not in message
    (store.root / "broken.safetensors").write_bytes(b"\0" * 64)
    code, message = answer_of(url, body("broken", "Hi"))  # the reason names the file: by name, never by the path
    assert code == 404 and f"'{store.root.name}/broken.safetensors' is not a readable" in message, message
    assert str(store.root) not in message and str(store.root.parent) not in message
    code, message = answer_of(url, body("nope", "Hi"))
    assert code == 404 and "No cartridge 'nope'" in message and str(store.root.parent) not in message
    assert answer_of(url, body("c2", "Hi"))[0] == 200
    # the CLI refuses it the same way, naming the fix
    out = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", "ask", str(tmp_path / "anon.safetensors"), "Hi",
                          "--max-new-tokens", "2"], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "does not say which model" in out.stderr
    assert "pass --model" in out.stderr


def _request(cartridge):
    from cartridges_sdk import GenerationParams, GenerationRequest

    return GenerationRequest([{"role": "user", "content": "Hi"}], [cartridge], GenerationParams(max_new_tokens=2))


# ---- case 3: DNS rebinding

def test_only_requests_addressed_to_the_server_are_answered(store, tiny_llama):
    app = create_app(store, tiny_llama.get_runtime("hf"))  # no key: loopback only, as the CLI's default binds
    with serving(app) as url:
        port = url.split(":")[2].split("/")[0]
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.2", "localhost.attacker.example"):
            r = httpx.get(f"{url}/models", headers={"host": host})
            assert r.status_code == 403 and "--allowed-host" in r.json()["error"]["message"], host
            assert "c0" not in r.text
            assert httpx.get(f"{url.removesuffix('/v1')}/docs", headers={"host": host}).status_code == 403
        # read by some as 127.0.0.1 or ::1, by others as evil.example: refused, not guessed at
        for host in ("127.0.0.1:80@evil.example", "[::1]evil.example", "[::1]:80.evil.example", "localhost:80/x"):
            r = httpx.get(f"{url}/models", headers={"host": host})
            assert r.status_code == 400 and r.json()["error"]["param"] == "host", host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
            assert httpx.get(f"{url}/models", headers={"host": host}).status_code == 200, host
        # a page elsewhere posting straight to 127.0.0.1 (no rebinding needed) carries its Origin: refused
        for origin in ("http://attacker.example", "null", "https://127.0.0.1.attacker.example:443",
                       "http://127.0.0.1:1@evil.example", "http://[::1]@evil.example", "http://[::1]evil.example",
                       "http://localhost/evil"):
            r = httpx.post(f"{url}/chat/completions", json=body("c0", "Hi"), headers={"origin": origin})
            assert r.status_code == 403 and "Origin" in r.json()["error"]["message"], origin
        r = httpx.post(f"{url}/chat/completions", json=body("c0", "Hi"), headers={"origin": f"http://localhost:{port}"})
        assert r.status_code == 200
    named = create_app(store, tiny_llama.get_runtime("hf"), ServeConfig(allowed_hosts=["box.internal"]))
    with serving(named) as url:
        assert httpx.get(f"{url}/models", headers={"host": "box.internal:80"}).status_code == 200
        assert httpx.get(f"{url}/models").status_code == 403  # only the names given


# ---- case 4: a file's metadata never chooses what is loaded

@pytest.mark.default_model
def test_ask_never_loads_the_model_a_file_names(tmp_path, default_lm, monkeypatch, capsys):
    import cartridges_sdk.models as models

    path = Cartridge.from_prefix(default_lm, TEXTS[0], 12).save(tmp_path / "c.safetensors")
    rewrite_meta(path, lambda m: m["model"].update(source="/etc", name="/etc"))
    loaded = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: loaded.append(a) or real(*a, **kw))
    assert cli(["ask", str(path), "Who logged storms?", "--max-new-tokens", "4"]) == 0
    assert loaded == [()]  # the embedded default, not "/etc"
    assert capsys.readouterr().out.strip()


# ---- case 5: JSON the parser rejects late

def test_json_that_fails_late_is_a_400(served):
    url, _ = served
    for raw, why in [('{"model": "c0", "max_tokens": ' + "9" * 5000 + "}", "too many digits"),
                     ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                     (json.dumps(body("c0", "Hi", seed=int("1" * 400))), "seed="),
                     (b'{"model": "\xff"}', "not valid JSON"),
                     (json.dumps(body("c0", "\ud800")), "lone UTF-16 surrogate")]:
        r = post(url, raw)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (r.status_code, r.text[:200])
        if why == "seed=":
            assert r.json()["error"]["param"] == "seed"


# ---- case 6: the smaller ones

def test_the_api_pages_are_behind_the_key(served):
    url, _ = served
    root = url.removesuffix("/v1")
    for page in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
        assert httpx.get(root + page).status_code == 401, page
        assert httpx.get(root + page, headers={"authorization": f"Bearer {KEY}"}).status_code == 200, page
    assert httpx.get(root + "/health").status_code == 200  # the one open path: says up or down, nothing else


def test_a_non_ascii_api_key_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="printable ASCII"):
        ServeConfig(api_key="clé-secrète")
    out = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", "serve", "--store", str(tmp_path),
                          "--api-key", "clé"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "printable ASCII" in out.stderr and "Traceback" not in out.stderr


def test_a_tiny_temperature_decodes_greedily(served, tiny_llama, store):
    url, _ = served
    want = tiny_llama.ask("Who logged storms?", cartridges=[store.get("c4")], max_new_tokens=8)
    assert answer_of(url, body("c4", "Who logged storms?", temperature=1e-300)) == (200, want)


def test_links_out_of_the_store_are_refused(tmp_path, tiny_llama):
    secret = tmp_path / "secret.txt"
    secret.write_text("the root password is hunter2")
    outside = Cartridge.from_prefix(tiny_llama, TEXTS[1], 8).save(tmp_path / "outside.safetensors")
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.add("ok", Cartridge.from_prefix(tiny_llama, TEXTS[0], 8), corpus=TEXTS[0])
    (store.root / "leak.corpus.txt").symlink_to(secret)
    store.add("leak", Cartridge.from_prefix(tiny_llama, TEXTS[2], 8))
    (store.root / "elsewhere.safetensors").symlink_to(outside)
    store.refresh()
    assert store.names() == ["ok"]
    assert "link to a file outside" in store.refused()["leak.safetensors"]
    assert "link to a file outside" in store.refused()["elsewhere.safetensors"]
    with pytest.raises(ConfigError, match="shares no word"):
        store.route("hunter2 password")  # the linked text was never indexed
    (store.root / "leak.corpus.txt").unlink()  # the link removed: the cartridge is served again
    store.refresh()
    assert store.names() == ["leak", "ok"]


def test_crafted_metadata_is_refused_by_name_not_a_traceback(tmp_path, tiny_llama):
    good = Cartridge.from_prefix(tiny_llama, TEXTS[0], 8)
    cases = {"parts": (lambda m: m.update(parts=[{"x": 1}]), "parts[0]"),
             "corpus": (lambda m: m.update(corpus="str"), "corpus='str'"),
             "frozen": (lambda m: m.update(num_frozen="1"), "num_frozen='1'"),
             "name": (lambda m: m["model"].update(name=["x"]), "name"),
             "arch": (lambda m: m["model"].update(architecture="x"), "architecture")}
    for label, (change, named) in cases.items():
        path = rewrite_meta(good.save(tmp_path / f"{label}.safetensors"), change)
        with pytest.raises(CartridgeFormatError, match="unreadable cartridge metadata"):
            Cartridge.load(path)
        for command in (["inspect", str(path)], ["ask", str(path), "Hi"]):
            out = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", *command], capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 2 and "Traceback" not in out.stderr and named in out.stderr, (label, out.stderr)
    anon = rewrite_meta(good.save(tmp_path / "anon.safetensors"), lambda m: m.pop("model"))
    out = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", "inspect", str(anon)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "not reported" in out.stdout  # inspect shows what the file says, and what it lacks


def test_a_stream_that_fails_midway_ends_with_done(store, tiny_llama):
    app = create_app(store, testing.failing(tiny_llama.get_runtime("hf")), ServeConfig(api_key=KEY))
    with serving(app) as url:
        code, message = answer_of(url, body("c0", f"{testing.POISON} now", max_tokens=12, stream=True))
        assert code == 500 and "poisoned" in message  # answer_of asserts the [DONE]


# ---- fuzz: a few hundred malformed bodies, no 5xx, and a good request alongside gets its answer

def _malformed(rng: random.Random) -> bytes | dict:
    junk = [None, True, -1, 0, 2**70, 1e308, float("nan"), "", "x" * 300, [], {}, [1, "a"], {"a": {"b": []}},
            "\u0000", "\ud7ff", "\ud800", "x\udfff", -0.0]
    good = body("c0", "Hi")
    kind = rng.randrange(5)
    if kind == 0:  # one field set to junk
        field = rng.choice(["model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                            "stream_options", "n", "cartridges", "k", "user", "presence_penalty"])
        return good | {field: rng.choice(junk)}
    if kind == 1:  # a broken message
        message = rng.choice([{"role": rng.choice(junk)}, {"content": rng.choice(junk)}, rng.choice(junk),
                              {"role": "user", "content": rng.choice(junk)}, {"role": "tool", "content": "x"}])
        return good | {"messages": [message]}
    if kind == 2:  # bytes cut at a random place, or with a byte flipped
        raw = bytearray(json.dumps(good | {"stream": rng.random() < 0.5}).encode())
        if rng.random() < 0.5:
            return bytes(raw[: rng.randrange(len(raw))])
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    if kind == 3:  # not an object
        return json.dumps(rng.choice(junk)).encode() if rng.random() < 0.5 else rng.randbytes(rng.randrange(64))
    return good | {rng.choice(["tools", "logprobs", "", "\u00e9", "model "]): rng.choice(junk)}


def test_fuzz_no_5xx_and_the_good_request_is_answered(served, tiny_llama, store):
    url, app = served
    rng = random.Random(27)
    want = tiny_llama.ask("Who logged storms?", cartridges=[store.get("c5")], max_new_tokens=8)
    good = body("c5", "Who logged storms?")
    bodies = []
    for _ in range(300):
        b = _malformed(rng)
        bodies.append(b if isinstance(b, bytes) else json.dumps(b, allow_nan=True).encode())
    deadline = time.monotonic() + 240
    statuses = []

    def send(raw: bytes) -> int:
        if time.monotonic() > deadline:
            return -1
        r = post(url, raw)
        if r.status_code == 200 and b'"stream": true' in raw:
            r.read()
        return r.status_code

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(answer_of, url, good) for _ in range(3)]
        statuses = list(pool.map(send, bodies))
        assert [g.result() for g in goods] == [(200, want)] * 3
    assert -1 not in statuses, "the fuzz run did not finish in time"
    assert not [s for s in statuses if s >= 500], sorted(set(statuses))
    assert httpx.get(f"{url.removesuffix('/v1')}/health").json()["status"] == "ok"
    assert answer_of(url, good) == (200, want)


def test_a_client_that_leaves_stops_its_decoding(store, tiny_llama):
    class Slow(HFRuntime):  # the real runtime, each step 50 ms: 400 tokens would take 20 s
        def step(self):
            time.sleep(0.05)
            return super().step()

    app = create_app(store, Slow(tiny_llama), ServeConfig(api_key=KEY))
    with serving(app) as url:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/chat/completions", json=body("c0", "Tell a long story.", max_tokens=400),
                       headers={"authorization": f"Bearer {KEY}"}, timeout=1)
        engine = app.state.engine
        while engine.in_flight and time.monotonic() - start < 30:
            time.sleep(0.05)
        assert engine.in_flight == 0 and time.monotonic() - start < 8  # dropped, not decoded to the end


def test_messages_the_chat_template_refuses_are_a_400(served, tiny_llama, monkeypatch):
    url, _ = served
    real = tiny_llama.chat_ids

    def strict(messages, **kw):  # as Gemma's template does with a system turn
        if any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        return real(messages, **kw)

    monkeypatch.setattr(tiny_llama, "chat_ids", strict)
    r = post(url, {**body("c0", "Hi"), "messages": [{"role": "system", "content": "x"},
                                                   {"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and "chat template refuses" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
