"""A hostile probe of `cartridges serve --keys --audit-log`: two clinicians' keys over four patients' records, tried
as an attacker (or a careless clinician) would, each probe printed with what a safe server does and what this one
did. Run it alone; it starts its own servers on 127.0.0.1 and stops them.

    python -m benchmarks.access_probe [--reader default] [--out benchmarks/results/access_probe.json]

Mechanics (audit lines, streams, floods, headers) run on a tiny random model, whose answers never stop early; the
clinical hazard (a question naming another clinician's patient under `auto`) runs on `--reader`, so its answer, when
one is given, reads as a reader's would. It runs on earlier versions of the server too, to compare: a setting they
lack (subjects, the per-address limit) is left out there.
"""

from __future__ import annotations

import argparse
import inspect
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx

from cartridges_sdk import Cartridge, CartridgeStore, load_model
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.serve.access import KeyFile
from cartridges_sdk.serve.background import serving
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import ServeConfig
from cartridges_sdk.testing import tiny_lm

RECORDS = {
    "patient-0001": ("Ada Quill", "Patient Ada Quill was born on March 3, 1961, in Harrow. Diagnosis: sarcoidosis."),
    "patient-0002": ("Ben Oduya", "Patient Ben Oduya was born on July 19, 1974, in Tarrow. Diagnosis: gout."),
    "patient-0003": ("Cy Marlowe", "Patient Cy Marlowe was born on January 22, 2010, in Fenwick. Diagnosis: asthma."),
    "patient-0004": ("Dee Lantern", "Patient Dee Lantern was born on May 8, 1990, in Oxley. Diagnosis: anaemia."),
}
OPENS = {"clin-a": ["patient-0001", "patient-0002"], "clin-b": ["patient-0003", "patient-0004"]}
FORGERY = "\u2028FORGED-LINE key=clin-a read patient-0001.txt status=200\u2029\u0085\u202e"


@attrs.define
class Probe:
    """One probe: what a safe server does, what this one did, and whether that is safe."""

    name: str
    safe: str
    seen: str = ""
    ok: bool = False


@attrs.define
class Clinic:
    url: str
    keys: KeyFile
    tokens: dict[str, str]
    log: Path
    root: Path

    def post(self, who: str | None, body: dict, path: str = "/chat/completions", **headers: str) -> httpx.Response:
        if who is not None:
            headers["authorization"] = f"Bearer {self.tokens.get(who, who)}"
        return httpx.post(self.url + path, json=body, headers=headers, timeout=600)

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text("utf-8").split("\n") if line]


def ask(model: str, question: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0,
            **extra}


def _config(**settings) -> ServeConfig:
    """`settings` this version of ServeConfig knows (an earlier one lacks auth_failures)."""
    known = {f.name for f in attrs.fields(ServeConfig)}
    return ServeConfig(**{k: v for k, v in settings.items() if k in known})


@contextmanager
def clinic(lm, root: Path, **settings) -> Iterator[Clinic]:
    """A store of the four records (each saying whose it is, where this version can), keys for two clinicians,
    an audit log, and a real server."""
    store = CartridgeStore(root / "store", lm)
    subjects = "subject" in inspect.signature(store.add).parameters
    for name, (who, text) in RECORDS.items():
        store.add(name, Cartridge.from_prefix(lm, text, len(lm.encode(text))), corpus=text,
                  **({"subject": who} if subjects else {}))
    keys = KeyFile(root / "keys.json", create=True)
    tokens = {who: keys.add(who, names, rate="1000/minute") for who, names in OPENS.items()}
    config = _config(keys_file=root / "keys.json", audit_log=root / "audit.jsonl", **settings)
    with serving(create_app(store, lm.get_runtime("hf"), config)) as url:
        yield Clinic(url, keys, tokens, root / "audit.jsonl", root)


def audit_probes(c: Clinic) -> list[Probe]:
    hidden = Probe("17th name in the audit line", "the line names the other clinician's patient asked for 17th")
    before = len(c.lines())
    c.post("clin-b", ask("patient-0003", "Hi", cartridges=["patient-0003"] * 16 + ["patient-0001"]))
    time.sleep(0.3)
    asked = c.lines()[before].get("asked", [])
    hidden.seen = f"asked holds {len(asked)} names; patient-0001 {'in' if 'patient-0001' in asked else 'NOT in'} it"
    hidden.ok = "patient-0001" in asked
    forged = Probe("U+2028/2029/0085/202E from a request", "none written raw; str.splitlines() sees no forged line")
    c.post("clin-b", ask("patient-0003" + FORGERY, "Hi", user="nurse" + FORGERY))
    c.post(None, ask(FORGERY, "Hi", user=FORGERY), path="/chat/completions" + FORGERY)
    time.sleep(0.3)
    raw = c.log.read_text("utf-8")
    split = [line for line in raw.splitlines() if line.startswith("FORGED")]
    forged.seen = (f"{sum(raw.count(ch) for ch in FORGERY[0] + FORGERY[-3:])} raw separators/controls; "
                   f"{len(split)} forged lines when read with splitlines()")
    forged.ok = not split and not any(ch in raw for ch in "\u2028\u2029\u0085\u202e")
    echo = Probe("a 100 KB name", "the 404 does not echo it whole")
    r = c.post("clin-b", ask("x" * 100_000, "Hi"))
    echo.seen, echo.ok = f"{r.status_code}, {len(r.content):,} bytes", r.status_code == 404 and len(r.content) < 2000
    return [hidden, forged, echo]


def stream_probe(c: Clinic) -> Probe:
    probe = Probe("a stream running when its key is revoked", "it ends within a second, with an error event, logged")
    token = c.keys.add("locum", ["patient-0003"], rate="100/minute")
    chunks, after, start, error = 0, 0, None, None
    with httpx.stream("POST", c.url + "/chat/completions", headers={"authorization": f"Bearer {token}"},
                      json=ask("patient-0003", "Tell me everything.", stream=True, max_tokens=1500), timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            event = json.loads(line[6:])
            error = event.get("error", error)
            if start is not None:
                after += 1
            elif chunks == 20:
                c.keys.revoke("locum")
                start = time.monotonic()
    took = time.monotonic() - start
    time.sleep(0.3)
    ended = [line.get("ended") for line in c.lines() if line.get("key") == "locum"]
    probe.seen = (f"{after} chunks and {took:.2f} s after the revocation; error event: "
                  f"{error['type'] if error else 'none'}; audit: {ended}")
    probe.ok = took < 1.0 and error is not None and "key-revoked" in ended
    return probe


def flood_probe(c: Clinic) -> Probe:
    probe = Probe("40 requests with wrong keys from one address", "429 after the limit; a few audit lines, not 40")
    before = len(c.lines())
    statuses = [c.post(f"ck-wrong-{i}", ask("patient-0001", "q")).status_code for i in range(40)]
    time.sleep(0.3)
    lines = len(c.lines()) - before
    probe.seen = f"{statuses.count(401)} x 401, {statuses.count(429)} x 429; {lines} audit lines"
    probe.ok = statuses.count(429) > 0 and lines < 20
    return probe


def header_probes(c: Clinic) -> list[Probe]:
    probes = []
    for header, value in [("host", "127.0.0.1:80@evil.example"), ("host", "[::1]evil.example"),
                          ("origin", "http://127.0.0.1:1@evil.example"), ("origin", "http://[::1]@evil.example")]:
        r = httpx.get(c.url + "/models", headers={header: value, "authorization": f"Bearer {c.tokens['clin-a']}"})
        probes.append(Probe(f"{header.title()}: {value}", "refused (4xx)", str(r.status_code), 400 <= r.status_code < 500))
    return probes


def broken_keys_probe(c: Clinic) -> Probe:
    probe = Probe("a key file broken by hand", "503 to every request, with a key or without")
    path = c.root / "keys.json"
    saved = path.read_text()
    path.write_text(saved[:-5])
    try:
        statuses = [c.post(who, ask("patient-0001", "q")).status_code for who in ("clin-a", None, "ck-wrong")]
    finally:
        path.write_text(saved)
    probe.seen, probe.ok = f"{statuses} (a key, none, a wrong one)", set(statuses) == {503}
    return probe


def unwritable_probe(lm, root: Path) -> Probe:
    probe = Probe("an audit log that cannot be written (/dev/full)", "no request answered 200, the first included")
    root.mkdir()
    (root / "audit.jsonl").symlink_to("/dev/full")
    with clinic(lm, root) as c:
        statuses = [c.post("clin-a", ask("patient-0001", "q", stream=stream)).status_code
                    for stream in (False, True, False)]
    probe.seen, probe.ok = f"{statuses} (whole, streamed, whole)", 200 not in statuses
    return probe


def subject_probes(c: Clinic) -> tuple[list[Probe], list[str]]:
    """Clinician B, under auto, asks about A's patient and about nobody; and the raw responses."""
    probes = []
    theirs = RECORDS["patient-0001"][0]
    other = c.post("clin-b", ask("auto", f"When was {theirs} born?"))
    nobody = c.post("clin-b", ask("auto", "When was Zed Nobody born?"))
    answer = other.json()["choices"][0]["message"]["content"] if other.status_code == 200 else other.json()["error"]["message"]
    probes.append(Probe(f"B asks when {theirs} (A's patient) was born", "a 4xx, never an answer from B's records",
                        f"{other.status_code}: {answer[:120]!r} (from {other.json().get('cartridges')})",
                        400 <= other.status_code < 500))
    same = other.status_code == nobody.status_code and \
        other.text.replace(theirs, "Zed Nobody") == nobody.text
    probes.append(Probe("the same question about nobody", "the same status and words: existence not revealed",
                        f"{nobody.status_code}; {'same' if same else 'different'} body", same and other.status_code != 200))
    mine = c.post("clin-b", ask("auto", f"When was {RECORDS['patient-0003'][0]} born?"))
    probes.append(Probe("B asks about B's own patient", "answered from that patient's record",
                        f"{mine.status_code} from {mine.json().get('cartridges')}",
                        mine.status_code == 200 and mine.json().get("cartridges") == ["patient-0003"]))
    return probes, [other.text.replace(theirs, ""), nobody.text, mine.text]


def leak_probe(responses: list[str]) -> Probe:
    words = [w for name in OPENS["clin-a"] for w in RECORDS[name][1].replace(",", " ").replace(".", " ").split()
             if w[0].isupper() and w not in {"Patient", "Diagnosis", "March", "July"}] + OPENS["clin-a"]
    leaked = sorted({w for w in words for r in responses if w in r})
    return Probe("A's patients in B's responses", "nothing beyond the name B's question sent", f"leaked: {leaked}",
                 not leaked)


def run(reader: str, out: Path, lm=None) -> list[Probe]:
    """Every probe, printed and written to `out`; `lm`: the reader already loaded (else `reader` is loaded)."""
    tiny = tiny_lm("llama")
    probes: list[Probe] = []
    with tempfile.TemporaryDirectory() as tmp:
        with clinic(tiny, Path(tmp) / "mechanics", auth_failures="10/minute") as c:
            probes += audit_probes(c) + [stream_probe(c), broken_keys_probe(c)] + header_probes(c)
            probes.append(flood_probe(c))  # last: the address stays blocked for a minute
        probes.append(unwritable_probe(tiny, Path(tmp) / "unwritable"))
        if lm is None:
            lm = load_model() if reader == "default" else load_model(reader)
        with clinic(lm, Path(tmp) / "reader") as c:
            found, responses = subject_probes(c)
            probes += found + [leak_probe(responses)]
    for p in probes:
        print(f"[{'safe' if p.ok else 'UNSAFE'}] {p.name}\n    safe: {p.safe}\n    seen: {p.seen}")
    print(f"{sum(p.ok for p in probes)}/{len(probes)} safe")
    atomic_write_json(out, {"reader": reader, "probes": [attrs.asdict(p) for p in probes]})
    print(f"wrote {out}")
    return probes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reader", default="default", help="the model answering the clinical probe (default: the "
                        "embedded one)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/access_probe.json"))
    args = parser.parse_args(argv)
    run(args.reader, args.out)


if __name__ == "__main__":
    main()
