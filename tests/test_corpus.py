"""Corpus construction, chunk sampling and seed prompts."""

from __future__ import annotations

import random
import warnings

import pytest

from cartridges_sdk import ConfigError
from cartridges_sdk.making.corpus import ChunkSampler, Corpus
from cartridges_sdk.making.seeds import GENERIC_WEIGHTS, register_seed, sample_seed, seed_kinds


def test_from_texts_and_str():
    c = Corpus.from_texts(["alpha", "beta"], names=["a.txt", "b.txt"])
    assert "### a.txt" in c.text and "beta" in c.text
    assert Corpus.coerce("just some text").text == "just some text"


def test_empty_corpus_is_refused():
    with pytest.raises(ConfigError, match="empty"):
        Corpus.from_texts(["", "  \n"])


def test_from_directory_include_exclude_and_binary(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "core.py").write_text("def parse_config(): ...\n")
    (tmp_path / "README.md").write_text("# Demo\n")
    (tmp_path / "notes.txt").write_text("not included\n")
    (tmp_path / "pkg" / "blob.py").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.py").write_text("hidden")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Corpus.from_directory(tmp_path, include=["**/*.py", "**/*.md"], exclude=["**/tests/*"])
    names = [d.name for d in c.documents]
    assert names == ["README.md", "pkg/core.py"]
    assert "### pkg/core.py" in c.text  # each file introduced by its relative path
    assert len(caught) == 1 and "pkg/blob.py" in str(caught[0].message)


def test_from_files_globs(tmp_path):
    for n in ("a", "b"):
        (tmp_path / f"{n}.md").write_text(f"doc {n}")
    c = Corpus.from_files(str(tmp_path / "*.md"))
    assert len(c.documents) == 2
    with pytest.raises(ConfigError, match="No file matches"):
        Corpus.from_files(str(tmp_path / "*.rst"))


def test_directory_with_nothing_matching(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match="No text files"):
        Corpus.from_directory(tmp_path, include=["*.py"])


@pytest.mark.parametrize("n", [100, 3000, 20000])
def test_chunks_stay_in_bounds_and_repeat_with_the_seed(n):
    sampler = ChunkSampler(512, 4096)
    a = [sampler.sample(n, random.Random(5)) for _ in range(50)]
    assert a == [sampler.sample(n, random.Random(5)) for _ in range(50)]
    rng = random.Random(1)
    for _ in range(200):
        start, end = sampler.sample(n, rng)
        assert 0 <= start < end <= n
        assert min(512, n) <= end - start <= min(4096, n)


def test_chunk_sampler_validates():
    with pytest.raises(ConfigError, match="max_chunk"):
        ChunkSampler(1024, 512)


def test_seed_prompt_kinds_and_weights():
    assert {"structuring", "summarization", "question", "use_case", "creative", "generic"} <= set(seed_kinds())
    rng = random.Random(0)
    kinds = {sample_seed(rng)[0] for _ in range(200)}
    assert kinds == {"structuring", "summarization", "question", "use_case", "creative"}
    assert {sample_seed(rng, GENERIC_WEIGHTS)[0] for _ in range(20)} == {"generic"}
    assert {sample_seed(rng, {"question": 1.0, "creative": 0.0})[0] for _ in range(50)} == {"question"}
    with pytest.raises(ConfigError, match="Unknown seed"):
        sample_seed(rng, {"poetry": 1.0})


def test_register_a_seed_kind():
    register_seed("test_only_kind", lambda rng: "Ask about the second paragraph.")
    assert sample_seed(random.Random(0), {"test_only_kind": 1.0}) == ("test_only_kind", "Ask about the second paragraph.")


def test_a_long_line_of_text_is_text_not_a_path():
    line = "word " * 300  # over the OS's file-name limit, no newline
    assert Corpus.coerce(line).text == line.strip()
