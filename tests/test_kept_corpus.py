"""A self-study dataset keeps its corpus, so training from the dataset alone can start from the corpus compacted (the
default) or from its opening tokens; a corpus given anyway is checked against it; datasets made before it was kept
still load and ask for the corpus. (The command-line side is in test_cli.py::test_synthesize_then_train.)"""

from __future__ import annotations

import pytest
import torch

from cartridges_sdk import ConfigError, Corpus
from cartridges_sdk.making.dataset import CORPUS_TEXT, SelfStudyDataset
from cartridges_sdk.errors import CartridgeFormatError
from cartridges_sdk.hf import HFSynthesizer
from cartridges_sdk.making.selfstudy import train_cartridge
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize

from conftest import TEXT

CONFIG = SynthesisConfig(num_conversations=4, conversations_per_chunk=4, min_chunk=40, max_chunk=120, max_tokens_a=8,
                         max_tokens_b=8, top_k=5, seed=3, document_windows=0)


def _train(ds, lm, **kw):
    return train_cartridge(ds, lm, num_tokens=8, progress=False, **kw)


def test_training_starts_from_the_kept_corpus(tiny_llama, tmp_path):
    ds = synthesize(TEXT, tiny_llama, tmp_path / "d", CONFIG, synthesizer=HFSynthesizer(tiny_llama), progress=False)
    assert (tmp_path / "d" / CORPUS_TEXT).read_text(encoding="utf-8") == ds.corpus_text()
    alone = _train(ds, tiny_llama)  # init="compact", no corpus given
    given = _train(ds, tiny_llama, prefix_ids=tiny_llama.encode(ds.corpus_text()))
    assert alone.meta.training["init"] == "compact"
    assert all(torch.equal(a, b) for a, b in zip(alone.keys + alone.values, given.keys + given.values))
    with pytest.raises(ConfigError, match="differ from those of the corpus .* at token \\d+; leave prefix_ids out"):
        _train(ds, tiny_llama, prefix_ids=tiny_llama.encode("Something else entirely."))
    # a prefix start longer than the opening tokens the header keeps comes from the kept corpus too
    assert _train(SelfStudyDataset(ds.path), tiny_llama, init="prefix").meta.training["init"] == "prefix"


def test_a_changed_kept_corpus_is_refused_and_an_old_dataset_asks_for_the_corpus(tiny_llama, tmp_path):
    ds = synthesize(TEXT, tiny_llama, tmp_path / "d", CONFIG, synthesizer=HFSynthesizer(tiny_llama), progress=False)
    kept = tmp_path / "d" / CORPUS_TEXT
    kept.write_text(TEXT + " (edited)", encoding="utf-8")
    with pytest.raises(CartridgeFormatError, match="changed or damaged"):
        _train(SelfStudyDataset(ds.path), tiny_llama)
    synthesize(TEXT, tiny_llama, tmp_path / "d", CONFIG, synthesizer=HFSynthesizer(tiny_llama), progress=False)
    assert SelfStudyDataset(ds.path).corpus_text() == Corpus.coerce(TEXT).text  # synthesizing again repairs it
    kept.unlink()  # as a dataset made before datasets kept their corpus
    old = SelfStudyDataset(ds.path)
    assert old.corpus_text() is None and len(old) == 4
    with pytest.raises(ConfigError, match=r"init='compact' \(the default\) needs the whole corpus: pass --corpus"):
        _train(old, tiny_llama)
    assert _train(old, tiny_llama, prefix_ids=tiny_llama.encode(TEXT)).meta.training["init"] == "compact"
    # synthesizing again into it (same settings: nothing left to make) keeps the corpus from then on
    synthesize(TEXT, tiny_llama, tmp_path / "d", CONFIG, synthesizer=HFSynthesizer(tiny_llama), progress=False)
    assert SelfStudyDataset(ds.path).corpus_text() == Corpus.coerce(TEXT).text
