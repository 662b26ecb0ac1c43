"""Per-key access to a real `cartridges serve` on 127.0.0.1: two clinicians' keys over one store of patients, where
neither ever gets an answer, a name or a routing hit from the other's patients (by name, composed, under `auto`,
streamed, and in every error); keys changed in the file without a restart; rate limits; the audit log; and deleting
a patient (`CartridgeStore.forget`, `cartridges forget`, `cartridges keys`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from cartridges_sdk import Cartridge, CartridgeStore, ConfigError
from cartridges_sdk.cli import main as cli
from cartridges_sdk.errors import NotInStoreError
from cartridges_sdk.serve.access import KeyFile
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import ServeConfig
from cartridges_sdk.testing import serving

# each record has words no other has (its diagnosis, its town): a question with them routes there and nowhere else
RECORDS = {
    "patient-ada": "Patient Ada Quill, born 1961 in Harrow. Diagnosis: sarcoidosis. Medication: prednisone 20 mg.",
    "patient-ben": "Patient Ben Oduya, born 1974 in Tarrow. Diagnosis: gout. Medication: allopurinol 100 mg daily.",
    "patient-cy": "Patient Cy Marlowe, born 1958 in Fenwick. Diagnosis: myasthenia gravis. Medication: pyridostigmine.",
    "patient-dee": "Patient Dee Lantern, born 1990 in Oxley. Diagnosis: hemochromatosis. Treatment: phlebotomy.",
}
MINE = {"dr-a": ["patient-ada", "patient-ben"], "dr-b": ["patient-cy", "patient-dee"]}


@pytest.fixture(scope="module")
def clinic(tmp_path_factory, tiny_llama):
    """A store of four patients, a key file with a key for each clinician, an audit log, and a real server."""
    root = tmp_path_factory.mktemp("clinic")
    store = CartridgeStore(root / "store", tiny_llama)
    for name, text in RECORDS.items():  # each record says whose it is
        store.add(name, Cartridge.from_prefix(tiny_llama, text, 8), corpus=text, subject=patient(name))
    keys = KeyFile(root / "keys.json", create=True)
    tokens = {who: keys.add(who, names, rate="1000/minute") for who, names in MINE.items()}
    config = ServeConfig(keys_file=root / "keys.json", audit_log=root / "audit.jsonl")
    with serving(create_app(store, tiny_llama.get_runtime("hf"), config)) as url:
        yield url, tokens, keys, root


def call(url: str, token: str | None, body: dict, path: str = "/chat/completions") -> tuple[int, str, list[str]]:
    """(status, the whole raw response, the cartridges it says answered), streamed or not."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if body.get("stream"):
        with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as r:
            raw = r.read().decode()
        used = [json.loads(line[6:]).get("cartridges", []) for line in raw.splitlines() if line.startswith("data: {")]
        return r.status_code, raw, sorted({n for names in used for n in names})
    r = httpx.post(url + path, json=body, headers=headers, timeout=120)
    return r.status_code, r.text, r.json().get("cartridges", []) if r.status_code == 200 else []


def ask(model: str, question: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 3, "temperature": 0,
            **extra}


def patient(name: str) -> str:
    return RECORDS[name].split("Patient ")[1].split(",")[0]


def diagnosis(name: str) -> str:
    return RECORDS[name].split("Diagnosis: ")[1].split(".")[0]


def town(name: str) -> str:
    return RECORDS[name].split(" in ")[1].split(".")[0]


def others(who: str) -> list[str]:
    return [n for n in RECORDS if n not in MINE[who]]


def no_leak(raw: str, who: str) -> None:
    """Nothing of another clinician's patients in a response: not their names, not their records' words."""
    own = " ".join(RECORDS[n] for n in MINE[who])
    for name in others(who):
        assert name not in raw
        for word in {w.strip(".,:") for w in RECORDS[name].split()} - set(own.replace(".", " ").split()):
            if len(word) >= 4 and word.isalpha():  # its own words: names, town, diagnosis, drugs
                assert word not in raw


@pytest.mark.parametrize("who", sorted(MINE))
def test_a_clinician_sees_lists_and_is_answered_from_their_own_patients_only(clinic, who):
    url, tokens, _, _ = clinic
    token, own = tokens[who], MINE[who]
    listed = httpx.get(f"{url}/models", headers={"authorization": f"Bearer {token}"}).json()
    names = [m["id"] for m in listed["data"]]
    assert set(own) <= set(names) and not set(others(who)) & set(names)
    for stream in (False, True):
        status, raw, used = call(url, token, ask(own[0], "What is the diagnosis?", stream=stream))
        assert status == 200 and used == [own[0]]
        no_leak(raw, who)
        # each of the other's patients, by name or composed with an own one: a 404 that reads as for
        # a cartridge that does not exist, listing only the clinician's own
        for model, listed_names in [(n, None) for n in others(who)] + [(own[0], [own[1], n]) for n in others(who)]:
            extra = {"cartridges": listed_names} if listed_names else {}
            status, raw, used = call(url, token, ask(model, "What is the diagnosis?", stream=stream, **extra))
            assert status == 404 and used == []
            missing = call(url, token, ask("patient-nobody", "What is the diagnosis?", stream=stream))
            barred = raw.replace(next(n for n in others(who) if n in raw), "patient-nobody")
            assert json.loads(barred) == json.loads(missing[1])  # same text: existence is not revealed
            no_leak(barred, who)  # beyond the name the request itself sent


@pytest.mark.parametrize("who", sorted(MINE))
def test_auto_routes_among_a_clinicians_own_patients_only(clinic, who):
    url, tokens, _, _ = clinic
    token = tokens[who]
    for stream in (False, True):
        for name in RECORDS:  # a question in each patient's own words
            question = f"Who has {diagnosis(name)} and lives in {town(name)}?"
            for extra in ({}, {"k": 3}, {"budget": 100}, {"budget": 100, "passages": 40}):
                status, raw, used = call(url, token, ask("auto", question, stream=stream, **extra))
                if name in MINE[who]:
                    assert status == 200 and name in used
                # the other's patient's words: refused as matching nothing (the index holds the own corpora only),
                # or answered by an own patient for a word they share ("Patient", "born") - never by the other's
                assert status in (200, 400) and set(used) <= set(MINE[who])
                no_leak(raw.replace(question, ""), who)  # beyond the question the request itself sent
    # a question that only the other's records answer, and shares no word with the own: refused, naming nothing
    other = others(who)[0]
    status, raw, used = call(url, token, ask("auto", diagnosis(other)))
    assert status == 400 and "shares no word" in raw
    no_leak(raw.replace(diagnosis(other), ""), who)


@pytest.mark.parametrize("who", sorted(MINE))
def test_a_question_naming_a_patient_is_answered_from_their_record_or_refused(clinic, who):
    """Under `auto`, a question that names one of the key's patients is answered from that patient's record alone,
    even in another patient's words; one naming another clinician's patient gets, word for word, the 404 of one
    naming nobody at all, streamed or not, with k or budget, and in a follow-up."""
    url, tokens, _, _ = clinic
    token, own, theirs = tokens[who], MINE[who], others(who)
    for stream in (False, True):
        for name in own:
            first, family = patient(name).split()
            # the other own patient's diagnosis: routed by words alone, the wrong record would answer
            wrong = diagnosis(next(n for n in own if n != name))
            for said in (f"{first} {family}", f"{family.upper()}, {first}", f"{first[0]}. {family}'s",
                         f"Mx {family}", f"{first.lower()} {family.lower()}"):
                for extra in ({}, {"k": 2}, {"budget": 100}, {"passages": 64}):
                    status, raw, used = call(url, token, ask("auto", f"Does {said} have {wrong}?", stream=stream,
                                                             **extra))
                    assert status == 200 and used == [name], (said, extra)
        nobody = call(url, token, ask("auto", "When was Zed Nobody born?", stream=stream))
        assert nobody[0] == 404 and "No record you can open is about 'Zed Nobody'" in nobody[1]
        for name in theirs:
            for extra in ({}, {"k": 3}, {"budget": 100}):
                status, raw, used = call(url, token, ask("auto", f"When was {patient(name)} born?", stream=stream,
                                                         **extra))
                assert status == 404 and used == []
                assert json.loads(raw.replace(patient(name), "Zed Nobody")) == json.loads(nobody[1])
                no_leak(raw.replace(patient(name), ""), who)
        # the name in an earlier turn: the follow-up is refused too
        turns = [{"role": "user", "content": f"When was {patient(theirs[0])} born?"},
                 {"role": "assistant", "content": "I cannot say."}, {"role": "user", "content": "And the diagnosis?"}]
        status, raw, used = call(url, token, {**ask("auto", ""), "messages": turns, "stream": stream})
        assert status == 404 and used == []
    # a question that names no one routes as ever
    status, _, used = call(url, token, ask("auto", f"Who has {diagnosis(own[0])}?"))
    assert status == 200 and used == [own[0]]


def test_keys_are_checked_and_changed_without_a_restart(clinic):
    url, tokens, keys, root = clinic
    assert call(url, None, ask("patient-ada", "q"))[0] == 401
    assert call(url, tokens["dr-a"] + "x", ask("patient-ada", "q"))[0] == 401
    health = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert health == {"status": "ok"}  # no key needed there: it says nothing of the store
    temp = keys.add("locum", ["patient-cy"], rate="3/minute")  # refusals count too
    assert call(url, temp, ask("patient-cy", "q"))[0] == 200
    assert call(url, temp, ask("patient-ada", "q"))[0] == 404
    keys.allow("locum", ["patient-a*"])  # a pattern
    assert call(url, temp, ask("patient-ada", "q"))[0] == 200
    status, raw, _ = call(url, temp, ask("patient-ada", "q"))  # its own rate limit, counted per key
    assert status == 429 and "3/minute" in raw
    assert call(url, tokens["dr-a"], ask("patient-ada", "q"))[0] == 200  # the others are not held back
    new = keys.rotate("locum")
    assert call(url, temp, ask("patient-cy", "q"))[0] == 401
    keys.revoke("locum")
    assert call(url, new, ask("patient-cy", "q"))[0] == 401
    # a key file broken by hand: every request is refused until it is fixed (a revoked key never comes back)
    saved = (root / "keys.json").read_text()
    (root / "keys.json").write_text(saved[:-5])
    for token in (tokens["dr-a"], None, "ck-wrong"):  # the same for every request, one without a key too
        status, raw, _ = call(url, token, ask("patient-ada", "q"))
        assert status == 503 and "key file" in raw and str(root) not in raw
    (root / "keys.json").write_text(saved)
    assert call(url, tokens["dr-a"], ask("patient-ada", "q"))[0] == 200


def _settled_lines(log) -> int:
    """The log's line count once earlier tests' lines are in: a line is written just after its response is sent, so
    on a loaded machine the last one can land after the next test has started."""
    count, still = len(log.read_text().splitlines()), 0
    while still < 5:
        time.sleep(0.1)
        now = len(log.read_text().splitlines())
        count, still = now, (still + 1 if now == count else 0)
    return count


def test_the_audit_log_says_who_used_what_and_never_the_question(clinic):
    url, tokens, _, root = clinic
    log = root / "audit.jsonl"
    before = _settled_lines(log)
    secret = "Does the patient drink alcohol?"
    call(url, tokens["dr-b"], ask("patient-cy", secret, user="nurse-7"))
    call(url, tokens["dr-b"], ask("patient-ada", secret))
    call(url, tokens["dr-b"], ask("auto", "Who has myasthenia gravis?", stream=True))
    call(url, None, ask("patient-cy", secret))
    assert call(url, tokens["dr-b"], ask("patient-cy", secret, user={"x": 1}))[0] == 400
    for _ in range(100):  # a line is written once its response is over, so just after the client has it
        lines = [json.loads(line) for line in log.read_text().splitlines()[before:]]
        if len(lines) >= 5:
            break
        time.sleep(0.05)
    assert secret not in log.read_text()
    assert [(r["key"], r["status"], r.get("cartridges")) for r in lines] == [
        ("dr-b", 200, ["patient-cy"]), ("dr-b", 404, None), ("dr-b", 200, ["patient-cy"]), (None, 401, None),
        ("dr-b", 400, None)]
    assert lines[1]["asked"] == ["patient-ada"]  # the refused name a key asked for, for whoever reads the log
    assert lines[0]["user"] == "nurse-7" and lines[2]["stream"] is True and lines[0]["time"].endswith("+00:00")
    assert oct(os.stat(log).st_mode & 0o777) == "0o600"


def test_the_audit_log_names_every_name_asked_for_and_is_one_line_for_every_reader(clinic):
    """A 17th name (another clinician's patient behind 16 of one's own) is in the line; a long name is cut with a
    mark that says so; Unicode line and paragraph separators and bidi controls in a request are written escaped."""
    url, tokens, _, root = clinic
    log = root / "audit.jsonl"
    before = _settled_lines(log)
    probe = ["patient-cy"] * 16 + ["patient-ada"]
    assert call(url, tokens["dr-b"], ask("patient-cy", "Hi", cartridges=probe))[0] == 404
    status, raw, _ = call(url, tokens["dr-b"], ask("x" * 100_000, "Hi"))
    assert status == 404 and len(raw) < 2000 and "[cut: 100000 characters]" in raw  # the name is not echoed whole
    tricky = "\u2028FORGED-LINE key=clin-a read patient-0001.txt status=200\u2029\u0085\u202e"
    call(url, tokens["dr-b"], ask("patient-cy" + tricky, "Hi", user="nurse" + tricky))
    call(url, None, ask(tricky, "Hi", user=tricky), path="/chat/completions" + tricky)
    for _ in range(100):
        records = [json.loads(line) for line in log.read_text(encoding="utf-8").split("\n")[before:] if line]
        if len(records) >= 4:
            break
        time.sleep(0.05)
    assert records[0]["asked"] == probe
    assert records[1]["asked"] == ["x" * 200 + "...[cut: 100000 characters]"]
    assert records[2]["user"] == "nurse" + tricky and records[2]["asked"] == ["patient-cy" + tricky]
    raw = log.read_text(encoding="utf-8")
    assert not any(c in raw for c in "\u2028\u2029\u0085\u202e")
    assert len(raw.splitlines()) == len(raw.split("\n")) - 1  # str.splitlines splits where JSON lines do


def test_nothing_is_answered_that_the_audit_log_does_not_hold(tmp_path, tiny_llama):
    """An audit log that cannot be written (a full disk): the first request already is refused 503 before any answer
    byte, whole or streamed, as is every one after it."""
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.add("patient-ada", Cartridge.from_prefix(tiny_llama, RECORDS["patient-ada"], 8), corpus=RECORDS["patient-ada"])
    log = tmp_path / "audit.jsonl"
    log.symlink_to("/dev/full")  # every write fails with ENOSPC
    config = ServeConfig(api_key="sk-audit", audit_log=log)
    with serving(create_app(store, tiny_llama.get_runtime("hf"), config)) as url:
        for stream in (False, True, False):
            status, raw, used = call(url, "sk-audit", ask("patient-ada", "What is the diagnosis?", stream=stream))
            assert status == 503 and "audit log" in raw and used == [] and "data:" not in raw
        assert httpx.get(f"{url}/models", headers={"authorization": "Bearer sk-audit"}).status_code == 503


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_llama):
    """A second server over the clinic's records, its own key file and audit log, that lets an address fail to
    authenticate 5 times a minute (its own limit: the other tests' wrong keys come from the same address)."""
    root = tmp_path_factory.mktemp("guarded")
    store = CartridgeStore(root / "store", tiny_llama)
    for name, text in RECORDS.items():
        store.add(name, Cartridge.from_prefix(tiny_llama, text, 8), corpus=text)
    keys = KeyFile(root / "keys.json", create=True)
    config = ServeConfig(keys_file=root / "keys.json", audit_log=root / "audit.jsonl", auth_failures="5/minute")
    with serving(create_app(store, tiny_llama.get_runtime("hf"), config)) as url:
        yield url, keys, root / "audit.jsonl"


def _stream_until_stopped(url: str, token: str, stop_after: int, stop) -> tuple[int, float, list[dict]]:
    """Stream a long answer; after `stop_after` chunks call `stop`. (chunks after it, seconds after it, events)."""
    events, after, stopped_at = [], 0, None
    with httpx.stream("POST", url + "/chat/completions", headers={"authorization": f"Bearer {token}"}, timeout=120,
                      json=ask("patient-ada", "Tell me everything.", stream=True, max_tokens=1500)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if stopped_at is not None:
                after += 1
            elif len(events) == stop_after:
                stop()
                stopped_at = time.monotonic()
    return after, time.monotonic() - stopped_at, events


@pytest.mark.parametrize("how", ["revoke", "rotate", "deny"])
def test_a_running_stream_stops_when_its_key_is_revoked_rotated_or_loses_the_grant(guarded, how):
    url, keys, log = guarded
    who = f"locum-{how}"
    token = keys.add(who, ["patient-ada"], rate="100/minute")
    change = {"revoke": lambda: keys.revoke(who), "rotate": lambda: keys.rotate(who),
              "deny": lambda: keys.deny(who, ["patient-ada"])}[how]
    after, seconds, events = _stream_until_stopped(url, token, 20, change)
    # undisturbed, the same answer runs 1500 tokens (several seconds here): it was cut within a second
    assert seconds < 1.0 and after < 200
    error = events[-1]["error"]
    assert error["type"] == ("permission_error" if how == "deny" else "authentication_error")
    assert "stopped" in error["message"] and not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])
    # the line saying how it ended is written as the server closes the stream, which may be just after the client
    # has read the stream's last event: wait for it (a loaded machine once took longer than the read)
    deadline = time.monotonic() + 5
    while True:
        ended = [json.loads(line) for line in log.read_text().splitlines() if f'"{who}"' in line]
        if len(ended) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [(r["status"], r.get("ended")) for r in ended] == [
        (200, None), (200, "grant-withdrawn" if how == "deny" else "key-revoked")]
    assert ended[0]["request"] == ended[1]["request"]  # the stream's first line and how it ended, tied together


def test_failed_authentication_is_limited_per_address_and_logged_a_line_a_minute(guarded):
    url, keys, log = guarded
    good = keys.add("dr-flood", ["patient-ada"], rate="100/minute")
    before = len(log.read_text().splitlines())
    statuses = [call(url, f"ck-wrong-{i}", ask("patient-ada", "q"))[0] for i in range(3)]
    statuses += [httpx.get(f"{url}/models", headers={"host": f"evil-{i}.example"}).status_code for i in range(2)]
    statuses += [call(url, f"ck-wrong-{i}", ask("patient-ada", "q"))[0] for i in range(35)]
    # a refused Host counts as a failure too
    assert statuses[:5] == [401] * 3 + [403] * 2 and set(statuses[5:]) == {429}
    # past the limit, the address is refused whatever it sends, the right key too: guessing cannot go on
    status, raw, _ = call(url, good, ask("patient-ada", "q"))
    assert status == 429 and "failed authentications" in raw
    lines = [json.loads(line) for line in log.read_text().splitlines()[before:]]
    # 5 lines for the failures, 1 for the first refusal of the blocked address; the other 35 are only counted
    assert [r["status"] for r in lines] == [401] * 3 + [403] * 2 + [429]
    assert all(r["client"] == "127.0.0.1" for r in lines) and lines[-1]["refusals_not_logged"] == 0


def test_the_hostile_probe_of_issue_45_finds_every_probe_safe(tmp_path, default_lm, capsys):
    """benchmarks/access_probe.py, the probe docs/security.md reports, on the embedded reader: every probe safe
    (it found 13 of 15 unsafe before issue 45; the note of that issue has both runs)."""
    from benchmarks import access_probe

    probes = access_probe.run("default", tmp_path / "probe.json", lm=default_lm)
    assert [p.name for p in probes if not p.ok] == [], capsys.readouterr().out
    assert len(probes) == 15 and json.loads((tmp_path / "probe.json").read_text())["reader"] == "default"


def test_a_key_file_and_a_single_key_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="exclude each other"):
        ServeConfig(api_key="sk-one", keys_file=tmp_path / "keys.json")
    (tmp_path / "bad.json").write_text('{"format": "cartridges-keys/1", "keys": {"x": {"sha256": "no"}}}')
    with pytest.raises(ConfigError, match="'sha256' must be"):
        KeyFile(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="not a rate"):
        KeyFile(tmp_path / "k.json", create=True).add("dr-x", ["p"], rate="often")
    with pytest.raises(ConfigError, match="not a rate"):  # `limits` would keep the first and drop the rest
        KeyFile(tmp_path / "k.json").add("dr-x", ["p"], rate="60/minute,5/second")
    # a hand-written "none" is no limit, as `keys add --rate none` writes null
    keys = KeyFile(tmp_path / "k.json")
    keys.add("dr-y", ["p"], rate="1/minute")
    text = (tmp_path / "k.json").read_text().replace('"1/minute"', '"none"')
    (tmp_path / "k.json").write_text(text)
    assert keys.keys()["dr-y"].rate is None


def test_forgetting_a_patient_removes_every_file_made_from_the_record(tmp_path, tiny_llama, capsys):
    docs = tmp_path / "records"
    docs.mkdir()
    for name, text in RECORDS.items():
        (docs / f"{name}.txt").write_text(text)
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.sync(docs, progress=False)
    work = store.root / ".work"
    # what self-study leaves: the patient's own work folder, and a copy of it among another's distractors
    (work / "patient-ada.txt-0123456789abcdef").mkdir(parents=True)
    (work / "patient-ben.txt-fedcba9876543210" / "distractors").mkdir(parents=True)
    store.get("patient-ada.txt").save(work / "patient-ben.txt-fedcba9876543210/distractors/patient-ada.txt.safetensors")
    tiny_llama.model.save_pretrained(tmp_path / "tiny")  # the command loads its model by path
    tiny_llama.tokenizer.save_pretrained(tmp_path / "tiny")
    keys = KeyFile(tmp_path / "keys.json", create=True)
    keys.add("dr-a", ["patient-ada.txt", "patient-ben.txt"])
    keys.add("dr-all", ["*"])
    code = cli(["forget", "patient-ada.txt", "--store", str(store.root), "--documents", str(docs),
                "--keys", str(tmp_path / "keys.json"), "--model", str(tmp_path / "tiny")])
    out = capsys.readouterr().out
    assert code == 0
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "patient-ada" in str(p))
    assert left == []
    for gone in ("records/patient-ada.txt", "patient-ada.txt.safetensors", "patient-ada.txt.corpus.txt",
                 ".work/patient-ada.txt-0123456789abcdef", "from key dr-a's allow-list",
                 ".work/patient-ben.txt-fedcba9876543210"):  # trained among her: its checkpoints go too
        assert gone in out
    assert keys.keys()["dr-a"].allow == ("patient-ben.txt",) and keys.keys()["dr-all"].allow == ("*",)
    store.refresh()
    assert "patient-ada.txt" not in store and store.sync(docs, progress=False).counts()["num_added"] == 0
    # a document already deleted and synced away leaves copies in others' work folders: forget finds them on disk
    (docs / "patient-cy.txt").unlink()
    version = store.records()["patient-dee.txt"]["sha256"][:16]  # sync keeps the work of current versions only
    kept = work / f"patient-dee.txt-{version}" / "distractors"
    kept.mkdir(parents=True)
    store.get("patient-cy.txt").save(kept / "patient-cy.txt.safetensors")
    store.sync(docs, progress=False)
    assert "patient-cy.txt" not in store
    assert store.forget("patient-cy.txt") == [kept.parent] and not kept.parent.exists()
    with pytest.raises(NotInStoreError, match="No cartridge 'patient-cy.txt'"):
        store.forget("patient-cy.txt")
    # a document that is a link: the link goes, never what it points to
    outside = tmp_path / "elsewhere.txt"
    outside.write_text(RECORDS["patient-dee"])
    (docs / "patient-dee.txt").unlink()
    (docs / "patient-dee.txt").symlink_to(outside)
    store.sync(docs, progress=False)
    assert store.forget("patient-dee.txt", docs)[0] == docs / "patient-dee.txt"
    assert outside.exists() and not (docs / "patient-dee.txt").is_symlink()


def test_the_keys_command_prints_a_key_once_and_keeps_only_its_hash(tmp_path, capsys):
    path = str(tmp_path / "keys.json")
    assert cli(["keys", "add", "dr-a", "--keys", path, "--allow", "patient-1", "--rate", "10/minute"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("ck-") and key not in Path(path).read_text()
    assert KeyFile(path).authenticate(key).allow == ("patient-1",)
    assert cli(["keys", "allow", "dr-a", "patient-2", "--keys", path]) == 0
    assert "allow patient-1, patient-2" in capsys.readouterr().out
    assert cli(["keys", "rotate", "dr-a", "--keys", path]) == 0
    assert KeyFile(path).authenticate(key) is None
    assert cli(["keys", "revoke", "dr-zed", "--keys", path]) == 2
    assert "has no key 'dr-zed'; it has: dr-a" in capsys.readouterr().err
