"""CartridgeStore: a folder of cartridges by name, checked against the model, bad files left out with a log line,
a memory budget, re-reading the folder, and routing questions by BM25 over the cartridges' corpora (also on the 12
real QASPER papers)."""

from __future__ import annotations

import logging

import attrs

import pytest
import torch

from benchmarks.data import DEFAULT_DATA, EVALDATA, load_corpora, only_own_words
from cartridges_sdk import Cartridge, ConfigError, IncompatibleCartridgeError
from cartridges_sdk.generation import GenerationParams, GenerationRequest
from cartridges_sdk.kv import prefix_cache
from cartridges_sdk.serve.passages import passage_ids
from cartridges_sdk.serve.store import CartridgeStore, NotInStoreError

CORPORA = {
    "lighthouse": "The Harrow Point lighthouse was built in 1871 by the engineer Margaret Ellison. Its lamp burned "
                  "colza oil until a kerosene burner replaced it in 1904. Keepers lived in the cottage below.",
    "orchard": "The orchard at Fenwick grows seven kinds of apple. Pruning happens in late winter, and the cider "
               "press runs every October when the harvest is in.",
    "railway": "The branch railway to Colby opened in 1889 and closed in 1962. Its steam engines hauled slate down "
               "the valley to the harbour, three trains a day.",
}


@pytest.fixture
def store(tmp_path, tiny_llama):
    s = CartridgeStore(tmp_path / "store", tiny_llama)
    for name, text in CORPORA.items():
        s.add(name, Cartridge.from_prefix(tiny_llama, text, 12), corpus=text)
    return s


def test_cartridges_by_name(store, tiny_llama):
    assert store.names() == ["lighthouse", "orchard", "railway"] and len(store) == 3 and "orchard" in store
    got = store.get("orchard")
    assert got.num_tokens == 12 and got.lm is tiny_llama
    with pytest.raises(NotInStoreError, match=r"No cartridge 'harbour' in the store at .*; it holds: lighthouse, "
                       "orchard, railway"):
        store.get("harbour")
    with pytest.raises(ConfigError, match="already holds 'orchard'; pass replace=True"):
        store.add("orchard", got)
    store.add("orchard", Cartridge.from_prefix(tiny_llama, CORPORA["orchard"], 20), replace=True)
    assert store.get("orchard").num_tokens == 20
    store.remove("railway")
    assert store.names() == ["lighthouse", "orchard"] and not (store.root / "railway.corpus.txt").exists()
    for bad in ("../up", "", "auto", "a b"):
        with pytest.raises(ConfigError):
            store.add(bad, got)


def test_a_cartridge_of_another_model_is_refused(store, tiny_qwen):
    alien = Cartridge.from_prefix(tiny_qwen, CORPORA["orchard"], 12)
    with pytest.raises(IncompatibleCartridgeError, match="not the store's 'tiny-llama-seed0'"):
        store.add("alien", alien)


def test_bad_files_dropped_in_are_left_out_with_a_log_line_and_the_rest_is_served(store, tiny_qwen, caplog):
    (store.root / "damaged.safetensors").write_bytes(b"\x00garbage" * 100)
    Cartridge.from_prefix(tiny_qwen, CORPORA["railway"], 12).save(store.root / "foreign.safetensors")
    with caplog.at_level(logging.WARNING, logger="cartridges_sdk.store"):
        changes = store.refresh()
        assert changes == {"added": [], "removed": [], "refused": ["damaged", "foreign"]}
        assert store.refresh()["refused"] == []  # said once, not at every refresh
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "leaving out damaged.safetensors: " in said[0] and "not a readable cartridge" in said[0]
    assert "leaving out foreign.safetensors" in said[1] and "tiny-qwen2-seed0" in said[1]
    assert set(store.refused()) == {"damaged.safetensors", "foreign.safetensors"}
    assert store.names() == ["lighthouse", "orchard", "railway"] and store.get("railway").num_tokens == 12
    # a file replaced in place is read again; one deleted is dropped
    Cartridge.from_prefix(store.model, CORPORA["lighthouse"], 16).save(store.root / "lighthouse.safetensors")
    (store.root / "orchard.safetensors").unlink()
    assert store.refresh()["removed"] == ["orchard"]
    assert store.get("lighthouse").num_tokens == 16 and store.names() == ["lighthouse", "railway"]


def test_loaded_cartridges_stay_within_the_memory_budget(tmp_path, tiny_llama):
    one = Cartridge.from_prefix(tiny_llama, CORPORA["orchard"], 12)
    store = CartridgeStore(tmp_path, tiny_llama, memory_budget=one.nbytes + 1)
    for name in CORPORA:
        store.add(name, one)
    for name in CORPORA:
        store.get(name)
    assert list(store._memory) == ["railway"]  # the last one used; the others are read again when asked for
    assert store.get("orchard").num_tokens == 12 and list(store._memory) == ["orchard"]
    with pytest.raises(ConfigError, match="memory_budget=0 must be a positive number of bytes"):
        CartridgeStore(tmp_path, tiny_llama, memory_budget=0)


def test_questions_are_routed_to_the_cartridges_whose_corpora_answer_them(store, tiny_llama):
    assert [r.name for r in store.route("When did the railway to Colby close?")] == ["railway"]
    assert store.route("Who built the lighthouse at Harrow Point?", k=2)[0].name == "lighthouse"
    assert store.route("apple pruning and cider", k=3)[0].name == "orchard"
    answer = store.ask("When is the cider press used?", max_new_tokens=6)
    assert answer.cartridges == ("orchard",)
    assert answer.text == tiny_llama.ask("When is the cider press used?", cartridges=[store.get("orchard")],
                                         max_new_tokens=6)
    both = store.ask("Tell me about slate and apples.", cartridges=["railway", "orchard"], max_new_tokens=4)
    assert both.cartridges == ("railway", "orchard")
    with pytest.raises(ConfigError, match="k=0 must be a positive int"):
        store.route("apples", k=0)
    assert sorted(r.name for r in store.route("slate and cider", k=3)) == ["orchard", "railway"]  # not ...
    with pytest.raises(ConfigError, match="shares no word with the corpus of any cartridge"):  # ... the lighthouse
        store.route("zeppelin?")


def test_passages_fill_what_the_cartridges_leave_of_the_budget(store, tiny_llama):
    q = "When did the railway to Colby close?"
    plan = store.plan(q, budget=40, passages=20)
    assert plan.cartridges == ("railway",)  # 12 tokens each: one fits in 40 - 20, then ...
    assert plan.passages_kv.num_tokens == 40 - 12 and plan.prefix_ids == ()  # ... passages fill the rest
    assert plan.passages[0].name == "railway" and "closed in 1962" in plan.passages[0].text
    ids, kept = passage_ids(tiny_llama, plan.passages, 40 - 12, after_cartridge=False)
    assert kept == list(plan.passages) and len(ids) == 40 - 12
    assert tiny_llama.tokenizer.decode(ids, skip_special_tokens=True).startswith("From railway:\nThe branch")
    # read apart: the passages' own KV, placed after the cartridge as if computed there (never reading it)
    apart = Cartridge.compose([store.get("railway"), Cartridge.from_prefix(tiny_llama, ids, len(ids))],
                              reposition=True, model=tiny_llama)
    for k, v, k2, v2 in zip(plan.passages_kv.keys, plan.passages_kv.values, apart.keys, apart.values):
        torch.testing.assert_close(k, k2[:, 12:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, v2[:, 12:], rtol=1e-4, atol=1e-4)
    # passages of the routed documents only, or of the whole store (within `among`)
    assert {p.name for p in store.plan("railway and lighthouse", k=1, passages=200, passages_from="routed")
            .passages} == {store.route("railway and lighthouse")[0].name}
    assert {p.name for p in store.plan("railway and lighthouse", k=1, passages=200).passages} == {"railway",
                                                                                                   "lighthouse"}
    assert {p.name for p in store.plan("railway and lighthouse", k=1, passages=200, among=["lighthouse",
                                                                                           "orchard"]).passages} \
        == {"lighthouse"}
    # the answer is the cartridge with the passages in context before the question
    answer = store.ask(q, budget=40, passages=20, max_new_tokens=5)
    assert answer.cartridges == ("railway",) and answer.passages == plan.passages
    runtime = tiny_llama._runtime("hf", None)
    same = runtime.generate([GenerationRequest([{"role": "user", "content": q}], [apart],
                                               GenerationParams(max_new_tokens=5))])[0]
    assert answer.text == same.text
    assert store.plan(q, k=1).passages == () and store.plan(q, k=1, passages=0).passages_kv is None
    # with no cartridge in front (RAG alone), the passages are the prompt's first tokens
    rag = store.plan(q, cartridges=[], passages=20)
    assert rag.passages_kv is None and len(rag.prefix_ids) == 20
    # dense retrieval (all-MiniLM-L6-v2) ranks every passage, by meaning: the railway's first
    dense = store.plan("When did the trains to Colby stop running?", k=1, passages=1000, retrieval="dense")
    assert dense.passages[0].name == "railway" and len(dense.passages) == 3
    assert [p.score for p in dense.passages] == sorted((p.score for p in dense.passages), reverse=True)
    for bad, match in [({"passages": 40, "budget": 40}, "leaves nothing of budget=40 for cartridges"),
                       ({"passages": -1}, "passages=-1 must be a number of prompt tokens"),
                       ({"passages": 8, "retrieval": "tfidf"}, "retrieval='tfidf' must be one of"),
                       ({"passages": 8, "passages_from": "web"}, "passages_from='web' must be one of")]:
        with pytest.raises(ConfigError, match=match):
            store.plan(q, **bad)


def test_fused_retrieval_adds_up_the_bm25_and_dense_rankings(store):
    from cartridges_sdk.serve.passages import FUSED_K, PassageIndex

    chunks = ["The Colby railway closed in 1952, a year after the mine shut.",
              "Trains stopped running to the coast once the line was abandoned.",
              "The lighthouse keeper painted the tower white every spring.",
              "Apples from the orchard ripen in late September."]
    owners = ["railway", "railway", "lighthouse", "orchard"]
    index = {kind: PassageIndex(owners, chunks, kind) for kind in ("bm25", "dense", "fused")}
    q = "When did the Colby railway close?"
    ranks = {kind: [p.text for p in index[kind].ranked(q, 10)] for kind in ("bm25", "dense")}
    assert len(ranks["bm25"]) < len(chunks) == len(ranks["dense"])  # BM25 drops passages sharing no word
    fused = index["fused"].ranked(q, 10)
    want = {t: sum(1 / (FUSED_K + r.index(t) + 1) for r in ranks.values() if t in r) for t in chunks}
    assert {p.text: p.score for p in fused} == pytest.approx(want) and len(fused) == len(chunks)
    assert [p.score for p in fused] == sorted(want.values(), reverse=True)
    assert fused[0].text == chunks[0] and [p.name for p in index["fused"].ranked(q, 2)] == ["railway"] * 2
    # a question in other words than any passage's: BM25 finds nothing, and fused ranks as dense does
    other = "Which fruit is harvested in autumn?"
    assert index["bm25"].ranked(other, 10) == []
    assert [p.text for p in index["fused"].ranked(other, 10)] == [p.text for p in index["dense"].ranked(other, 10)]
    # within some documents only, as the other rankings are
    assert {p.name for p in index["fused"].ranked(q, 10, among=["lighthouse", "orchard"])} == {"lighthouse",
                                                                                                "orchard"}
    # fused from the two indexes as built: the same ranking; indexes of other passages are refused
    assert PassageIndex.fusing([index["bm25"], index["dense"]]).ranked(q, 10) == fused
    with pytest.raises(ValueError, match="same passages"):
        PassageIndex.fusing([index["bm25"], PassageIndex(owners[:2], chunks[:2], "dense")])
    # and through a store: the same ranking of its corpora's passages
    plan = store.plan(q, k=1, passages=1000, retrieval="fused")
    assert plan.passages and [p.score for p in plan.passages] == sorted((p.score for p in plan.passages),
                                                                        reverse=True)


def test_a_store_builds_each_passage_index_once(store, monkeypatch):
    """Fused retrieval reuses the store's BM25 and dense indexes of the same documents: the dense one embeds every
    passage, so building it twice would double an answer's slowest step."""
    from cartridges_sdk.serve.passages import PassageIndex

    built = []
    real = PassageIndex.of.__func__

    def counted(cls, texts, retrieval="bm25", **kw):
        built.append((retrieval, tuple(texts)))
        return real(cls, texts, retrieval, **kw)

    monkeypatch.setattr(PassageIndex, "of", classmethod(counted))
    q = "When did the Colby railway close?"
    dense = store.passages(q, k=50, retrieval="dense")
    fused = store.passages(q, k=50, retrieval="fused")
    assert [kind for kind, _ in built] == ["dense", "bm25"]  # fused built only the BM25 index it lacked
    assert store.passages(q, k=50, retrieval="bm25") and store.passages(q, k=50, retrieval="fused") == fused
    assert len(built) == 2 and {p.text for p in fused} == {p.text for p in dense}
    # within some documents: their own indexes, each built once too
    store.passages(q, retrieval="fused", among=["railway"])
    store.passages(q, retrieval="dense", among=["railway"])
    assert built[2:] == [("bm25", ("railway",)), ("dense", ("railway",))]


def test_a_store_embeds_each_document_once(store, tiny_llama):
    """Dense indexes take each document's passage embeddings from the store, which keeps them across changes: after
    a sync changed one document, only it is embedded again, and the ranking is the one of embedding all at once."""
    from cartridges_sdk.serve.passages import PassageIndex

    q = "When did the Colby railway close?"
    store.passages(q, retrieval="dense")
    assert store._embedded.made == 3
    store.passages(q, retrieval="fused", among=["railway", "orchard"])  # another index, the same embeddings
    assert store._embedded.made == 3
    harbour = "The harbour at Colby silted up after the railway closed, and the slate boats stopped calling."
    store.add("harbour", Cartridge.from_prefix(tiny_llama, harbour, 12), corpus=harbour)
    railway = CORPORA["railway"].replace("1962", "1963")
    store.add("railway", Cartridge.from_prefix(tiny_llama, railway, 12), corpus=railway, replace=True)
    ranked = store.passages(q, k=50, retrieval="dense")
    assert store._embedded.made == 5  # the new document and the changed one
    texts = {**CORPORA, "harbour": harbour, "railway": railway}
    whole = PassageIndex(sorted(texts), [texts[n] for n in sorted(texts)], "dense").ranked(q, 50)
    assert [p.text for p in ranked] == [p.text for p in whole] and len(ranked) == 4
    assert any("1963" in p.text for p in ranked) and not any("1962" in p.text for p in ranked)
    assert len(store._embedded) == 4  # a document's latest version only
    store.remove("orchard")  # a removed (or forgotten) document's embeddings go with it
    assert "orchard" not in store._embedded and len(store.passages(q, k=50, retrieval="dense")) == 3
    assert [p.score for p in ranked] == pytest.approx([p.score for p in whole], abs=1e-5)


def test_a_first_answer_picks_the_passages(store, tiny_llama):
    from cartridges_sdk.serve.passages import drafted

    q = "When did the railway to Colby close?"
    # passages are ranked against the query given, the question's cartridges unchanged
    asked = store.plan(q, budget=40, passages=20)
    other = store.plan(q, budget=40, passages=20, query="Who built the lighthouse?")
    assert other.cartridges == asked.cartridges == ("railway",)
    assert asked.passages[0].name == "railway" and other.passages[0].name == "lighthouse"
    # draft: the plan's greedy first answer, then its passages ranked against the question and that answer
    answer = store.ask(q, budget=40, passages=20, draft=6, max_new_tokens=5)
    first = store.ask(q, budget=40, passages=20, max_new_tokens=6, temperature=0.0)
    assert first.draft is None and answer.draft == first.text
    redone = store.plan(q, budget=40, passages=20, query=drafted(q, answer.draft))
    assert answer.passages == redone.passages and answer.cartridges == ("railway",)
    assert store.drafted_plan(q, 6, budget=40, passages=20) == (redone, answer.draft)
    runtime = tiny_llama._runtime("hf", None)
    same = runtime.generate([GenerationRequest([{"role": "user", "content": q}], redone.parts(store),
                                               GenerationParams(max_new_tokens=5))])[0]
    assert answer.text == same.text
    assert drafted(q, "  ") == q and drafted(q, "In 1962.") == f"{q}\nIn 1962."
    # draft_from: the same documents' cartridges in another store write it, alone (here the store itself)
    alone = store.ask(q, cartridges=["railway"], max_new_tokens=6, temperature=0.0)
    searches = []
    found = store.passages
    store.passages = lambda *a, **kw: searches.append(a) or found(*a, **kw)  # noqa: E731
    assert store.drafted_plan(q, 6, draft_from=store, budget=40, passages=20)[1] == alone.text
    assert searches == [(drafted(q, alone.text),)]  # passages sought once, with the first answer: none go unused
    del store.passages
    with pytest.raises(ConfigError, match="draft_from='elsewhere' must be a CartridgeStore"):
        store.ask(q, budget=40, passages=20, draft=6, draft_from="elsewhere")
    with pytest.raises(ConfigError, match="draft=0 writes none"):
        store.ask(q, budget=40, passages=20, draft_from=store)
    for bad, why in [({"draft": -1}, "draft=-1 must be a number of tokens"),
                     ({"draft": True}, "draft=True must be a number of tokens"),
                     ({"draft": 4, "budget": 40, "passages": 0}, "draft=4 ranks passages against a first answer, "
                                                                 "and this answer gets none")]:
        with pytest.raises(ConfigError, match=why):
            store.ask(q, max_new_tokens=2, **bad)
    with pytest.raises(ConfigError, match="query='' must be a non-empty text"):
        store.plan(q, budget=40, passages=20, query="")
    with pytest.raises(ConfigError, match="query= says what passages are ranked against, and this answer gets none"):
        store.plan(q, budget=40, query="Who built the lighthouse?")


def test_trim_cuts_the_cartridges_to_what_the_passages_leave_of_the_budget(store, tiny_llama):
    from cartridges_sdk.serve.passages import read_apart, trim_sizes

    q = "When did the railway to Colby close?"
    # a 12-token cartridge cut to its first 8 is the 8-token one: attention reads the kept keys as before
    whole = store.get("railway")
    cut = whole.truncated(8)
    exact = Cartridge.from_prefix(tiny_llama, CORPORA["railway"], 8)
    ids = tiny_llama.encode(q)
    torch.testing.assert_close(cut.logits(ids), exact.logits(ids), rtol=1e-4, atol=1e-4)
    assert cut.num_tokens == 8 and whole.num_tokens == 12 and whole.truncated(12) is whole
    reported = Cartridge(whole.keys, whole.values, attrs.evolve(whole.meta, extra={"quality": {"recovered": 0.9}}))
    assert reported.quality and reported.truncated(8).quality is None  # measured on all 12 tokens, not these 8
    # 12-token cartridges do not fit the 10 that 20 passage tokens leave of 30: the best is taken whole, over budget
    over = store.plan(q, budget=30, passages=20)
    assert over.cartridges == ("railway",) and over.sizes == () and over.passages_kv.num_tokens == 20
    # ... or, with trim, cut to fit, the passages read apart after its 10 tokens
    plan = store.plan(q, budget=30, passages=20, trim=True)
    assert plan.cartridges == ("railway",) and plan.sizes == (10,) and plan.passages[0].name == "railway"
    parts = plan.parts(store)
    assert [p.num_tokens for p in parts] == [10, 20]
    torch.testing.assert_close(parts[0].keys[-1], whole.keys[-1][:, :10])
    again = read_apart(tiny_llama, passage_ids(tiny_llama, plan.passages, 20, after_cartridge=False)[0], 10)
    torch.testing.assert_close(parts[1].keys[-1], again.keys[-1])
    answer = store.ask(q, budget=30, passages=20, trim=True, max_new_tokens=5)
    runtime = tiny_llama._runtime("hf", None)
    same = runtime.generate([GenerationRequest([{"role": "user", "content": q}], parts,
                                               GenerationParams(max_new_tokens=5))])[0]
    assert answer.text == same.text and answer.cartridges == ("railway",) and answer.sizes == (10,)
    # the plan answers with the cartridges it sized the cut and placed the passages by, even if a sync replaces one
    store.add("railway", Cartridge.from_prefix(tiny_llama, CORPORA["railway"], 6), corpus=CORPORA["railway"],
              replace=True)
    assert store.get("railway").num_tokens == 6
    torch.testing.assert_close(plan.parts(store)[0].keys[-1], whole.keys[-1][:, :10])
    store.add("railway", whole, corpus=CORPORA["railway"], replace=True)
    # named cartridges share what is left; one that fits stays whole
    assert store.plan(q, cartridges=["railway", "orchard"], budget=40, passages=20, trim=True).sizes == (10, 10)
    assert store.plan(q, cartridges=["railway"], budget=40, passages=20, trim=True).sizes == (12,)
    assert trim_sizes([4, 12, 12], 20) == (4, 8, 8) and trim_sizes([30, 3], 20) == (17, 3)
    # the first answer written by the whole cartridges alone (draft_from the store itself), the answer cut
    first = store.ask(q, cartridges=["railway"], max_new_tokens=4, temperature=0.0).text
    drafted_, draft = store.drafted_plan(q, 4, draft_from=store, budget=30, passages=20, trim=True)
    assert draft == first and drafted_.sizes == (10,)
    for bad, why in [({"budget": 30, "trim": True}, "trim=True cuts the cartridges to what passages leave"),
                     ({"passages": 20, "trim": True}, "trim=True cuts the cartridges to what passages leave"),
                     ({"budget": 30, "passages": 20, "trim": "yes"}, "trim='yes' must be True or False"),
                     ({"budget": 30, "passages": 27, "trim": True, "cartridges": ["railway", "orchard"]},
                      "2 cartridge\\(s\\) cannot be cut to fit 3")]:
        with pytest.raises(ConfigError, match=why):
            store.plan(q, **bad)
    with pytest.raises(ConfigError, match="greater than the cartridge's 1 frozen"):
        whole.truncated(1)
    # a composed cartridge (sync composes one for a document longer than the context) keeps its first parts
    both = Cartridge.compose([whole, store.get("orchard")])
    torch.testing.assert_close(both.truncated(20).logits(ids), Cartridge.compose([whole, store.get("orchard")
                                                                                  .truncated(8)]).logits(ids))
    assert [p["num_tokens"] for p in both.truncated(20).meta.parts] == [12, 8]
    assert [p["num_tokens"] for p in both.truncated(10).meta.parts] == [10]
    # a cartridge of one token (a one-token document's) is kept whole, and nothing is cut below its sinks
    tiny = Cartridge.from_prefix(tiny_llama, "Colby", 1, num_frozen=0)
    assert tiny.truncated(1) is tiny and trim_sizes([1, 12], 6) == (1, 5)


def test_trim_by_attention_keeps_what_the_question_reads_most(store, tiny_llama):
    from cartridges_sdk.serve.attended import attention_mass

    q = "When did the railway to Colby close?"
    whole = store.get("railway")  # 12 tokens, cut to the 10 that 20 passage tokens leave of 30
    plan = store.plan(q, budget=30, passages=20, trim="attention")
    assert plan.sizes == (10,) and plan.passages == store.plan(q, budget=30, passages=20, trim=True).passages
    cut, passages = plan.parts(store)
    assert cut.num_tokens == 10 and passages.num_tokens == 20 and cut.meta.num_frozen == whole.meta.num_frozen
    # the mass each cartridge token gets, read against the model's own attention weights (eager attention, every
    # query's weights over the cartridge's keys renormalised to a softmax over them alone)
    ids = tiny_llama.prompt_ids([{"role": "user", "content": q}], after_cartridge=True)
    mass = attention_mass(tiny_llama, whole, ids)
    before = tiny_llama.model.config._attn_implementation
    tiny_llama.model.set_attn_implementation("eager")
    try:
        cache, p = prefix_cache(tiny_llama, [whole], batch_size=1)
        with torch.inference_mode():
            out = tiny_llama.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(p, p + len(ids))[None],
                                   attention_mask=torch.ones(1, p + len(ids), dtype=torch.long),
                                   past_key_values=cache, output_attentions=True)
    finally:
        tiny_llama.model.set_attn_implementation(before)
    for layer, weights in enumerate(out.attentions):
        over = weights[0, :, :, :12] / weights[0, :, :, :12].sum(-1, keepdim=True)  # [heads, positions, 12]
        heads = over.shape[0]
        want = over.sum(1).view(whole.keys[0].shape[0], heads // whole.keys[0].shape[0], 12).sum(1)
        torch.testing.assert_close(mass[layer], want, rtol=1e-4, atol=1e-4)
        # each kv head keeps its sink and its 9 most-read others, in order, keys and values as the whole's
        for h in range(want.shape[0]):
            kept = [0] + sorted(want[h, 1:].topk(9).indices.add(1).tolist())
            torch.testing.assert_close(cut.keys[layer][h], whole.keys[layer][h, kept])
            torch.testing.assert_close(cut.values[layer][h], whole.values[layer][h, kept])
    # some head keeps another token than the first ten: this is not the first-tokens cut
    assert any(not torch.equal(c, f) for c, f in zip(cut.keys, whole.truncated(10).keys))
    # the answer reads the cut cartridge and the passages after it, as the plan gives them
    answer = store.ask(q, budget=30, passages=20, trim="attention", max_new_tokens=5)
    same = tiny_llama._runtime("hf", None).generate([GenerationRequest([{"role": "user", "content": q}],
                                                                       [cut, passages],
                                                                       GenerationParams(max_new_tokens=5))])[0]
    assert answer.text == same.text and answer.sizes == (10,)
    # with a first answer, what is cut by is the question and that answer, as the passages are ranked against it
    drafted_, first = store.drafted_plan(q, 4, draft_from=store, budget=30, passages=20, trim="attention")
    assert first.strip()
    expected = store.plan(q, budget=30, passages=20, trim="attention", query=f"{q}\n{first}").parts(store)[0]
    torch.testing.assert_close(drafted_.parts(store)[0].keys[0], expected.keys[0])
    # "first" is True; anything else is refused, naming what trim takes
    assert store.plan(q, budget=30, passages=20, trim="first").sizes == (10,)
    torch.testing.assert_close(store.plan(q, budget=30, passages=20, trim="first").parts(store)[0].keys[0],
                               whole.truncated(10).keys[0])
    with pytest.raises(ConfigError, match="trim='middle' must be True or False, or one of \\['first', 'attention'\\]"):
        store.plan(q, budget=30, passages=20, trim="middle")
    with pytest.raises(ConfigError, match="trim='attention' cuts the cartridges to what passages leave"):
        store.plan(q, budget=30, trim="attention")


def test_selected_keeps_each_heads_own_tokens(store, tiny_llama):
    from cartridges_sdk.serve.attended import attended

    whole = store.get("orchard")
    kv_heads = whole.keys[0].shape[0]
    kept = [torch.tensor([[0, 2, 5, 11]] * kv_heads) for _ in whole.keys]
    kept[0][-1] = torch.tensor([0, 1, 2, 3])  # one head of one layer keeps other tokens
    got = whole.selected(kept)
    assert got.num_tokens == 4 and got.lm is tiny_llama and got.meta.extra["selected_from"] == 12
    torch.testing.assert_close(got.keys[1], whole.keys[1][:, [0, 2, 5, 11]])
    torch.testing.assert_close(got.values[0][-1], whole.values[0][-1, :4])
    for bad, why in [([k[:, :3] for k in kept[:-1]], "one \\[kv_heads=.*, n\\] tensor of token indices for each"),
                     ([torch.tensor([[2, 0, 5, 11]] * kv_heads)] * len(kept), "must rise within 0..11 and keep"),
                     ([torch.tensor([[1, 2, 5, 11]] * kv_heads)] * len(kept), "keep the sink token\\(s\\) \\[0\\]"),
                     ([torch.tensor([[0, 2, 5, 12]] * kv_heads)] * len(kept), "must rise within 0..11"),
                     ([torch.arange(12).expand(kv_heads, -1)] * len(kept), "keeps n=12 of 12 tokens")]:
        with pytest.raises(ConfigError, match=why):
            whole.selected(bad)
    # a composition keeps each part's sink: the second part's starts at 12
    both = Cartridge.compose([whole, store.get("railway")])
    assert both.sinks == [0, 12]
    with pytest.raises(ConfigError, match="keep the sink token\\(s\\) \\[0, 12\\] in every head"):
        both.selected([torch.tensor([[0, 2, 5, 11]] * kv_heads)] * len(kept))
    cut = both.selected([torch.tensor([[0, 3, 12, 20]] * kv_heads)] * len(kept))
    torch.testing.assert_close(cut.keys[2], both.keys[2][:, [0, 3, 12, 20]])
    assert cut.meta.parts == () and cut.num_frozen == 1
    ids = tiny_llama.prompt_ids([{"role": "user", "content": "Who planted the orchard?"}], after_cartridge=True)
    assert attended(tiny_llama, both, ids, 10).num_tokens == 10  # both sinks kept, or selected() would refuse
    plan = store.plan("When did the railway to Colby close?", cartridges=["orchard", "railway"], budget=40,
                      passages=20, trim="attention")
    assert [c.num_tokens for c in plan.parts(store)[:2]] == [10, 10]


def test_a_readers_budget_is_shared_with_passages_by_default(store, tiny_llama, monkeypatch):
    from cartridges_sdk.making import settings
    from cartridges_sdk.serve.settings import PLAIN_TOKENS, READER_TOKENS, SyncConfig

    q = "When did the railway to Colby close, and who built the lighthouse?"
    # not a reader: a budget holds as many cartridges as fit, and no passage unless asked for (as before the rule)
    plain = store.plan(q, budget=40)
    with pytest.raises(ConfigError, match=r"retrieval='dense' says how passages are found.*budget is all cartridges"):
        store.ask(q, budget=40, retrieval="dense")
    assert len(plain.cartridges) == 2 and plain.passages == () and plain.passages_kv is None
    assert SyncConfig().for_model(tiny_llama).tokens == PLAIN_TOKENS
    n = tiny_llama.num_parameters
    monkeypatch.setattr(settings, "READER_PARAMETERS", (n, n + 1))  # counted a reader, as the 0.5B is
    assert SyncConfig().for_model(tiny_llama).tokens == READER_TOKENS
    assert SyncConfig(tokens=300).for_model(tiny_llama).tokens == 300
    # a reader: the best k that fit, then passages filling what they leave; the same plan as asking for them
    auto = store.plan(q, budget=40)
    asked = store.plan(q, budget=40, passages=40 - 12, k=1)
    assert auto.cartridges == asked.cartridges == plain.cartridges[:1] and auto.passages == asked.passages
    assert auto.passages_kv.num_tokens == 40 - 12
    assert store.plan(q, budget=40, k=2).cartridges == plain.cartridges
    assert store.plan(q, budget=40, k=2).passages_kv.num_tokens == 40 - 24
    # passages=0 turns it off; no budget, nothing to fill; cartridges that fill the budget leave no passage
    assert store.plan(q, budget=40, passages=0) == plain
    assert store.plan(q).passages == () and store.plan(q, budget=12).passages == ()
    # saying how passages are found is accepted where they are sought, and refused (not ignored) where none are
    assert store.plan(q, budget=40, retrieval="bm25", passages_from="store") == auto
    for bad, why in [({"budget": 40, "passages": 0, "retrieval": "dense"}, r"retrieval='dense'.*passages=0 turns"),
                     ({"passages_from": "routed"}, r"passages_from='routed'.*no budget is given"),
                     ({"retrieval": "bm25", "k": 2}, r"retrieval='bm25' says how passages are found")]:
        with pytest.raises(ConfigError, match=why):
            store.plan(q, **bad)
    answer = store.ask(q, budget=40, max_new_tokens=3)
    assert answer.passages == auto.passages and answer.cartridges == plain.cartridges[:1]


def test_rerank_adds_the_questions_calibrated_likelihood_to_bm25(store, tiny_llama):
    from cartridges_sdk.serve.rerank import NEUTRAL, lift, question_logprob, rerank

    q = "railway and lighthouse and orchard"
    routes = store.route(q, k=3)
    # the likelihood is the mean over the turn's tokens, the same as scoring them one by one
    ids = tiny_llama.prompt_ids([{"role": "user", "content": q}], after_cartridge=True)
    logits = tiny_llama.logits(ids, [store.get("railway")]).log_softmax(-1)
    direct = sum(float(logits[i, ids[i + 1]]) for i in range(len(ids) - 1)) / (len(ids) - 1)
    assert question_logprob(tiny_llama, q, store.get("railway")) == pytest.approx(direct, abs=1e-5)
    # each cartridge's lift is its mean over questions about nothing in particular
    assert lift(tiny_llama, store.get("orchard")) == pytest.approx(
        sum(question_logprob(tiny_llama, n, store.get("orchard")) for n in NEUTRAL) / len(NEUTRAL))

    def z(xs):
        m = sum(xs) / len(xs)
        s = (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5
        return [(x - m) / s for x in xs]

    calibrated = [question_logprob(tiny_llama, q, store.get(r.name)) - lift(tiny_llama, store.get(r.name))
                  for r in routes]
    want = sorted(zip([r.name for r in routes], [a + b for a, b in zip(z([r.score for r in routes]), z(calibrated))]),
                  key=lambda t: -t[1])
    ranked = rerank(store, q, routes)
    assert [n for n, _ in ranked] == [n for n, _ in want]
    assert [s for _, s in ranked] == pytest.approx([s for _, s in want])
    plan = store.plan(q, k=1, rerank=3)
    assert plan.cartridges == (ranked[0][0],) and plan.scores == (pytest.approx(ranked[0][1]),)
    assert store.plan(q, budget=24, rerank=3).cartridges == tuple(n for n, _ in ranked[:2])  # 12 tokens each
    assert rerank(store, q, routes[:1]) == [(routes[0].name, routes[0].score)]  # one candidate: nothing to rank
    with pytest.raises(ConfigError, match="rerank=-1 must be a number of candidates"):
        store.plan(q, rerank=-1)


@pytest.mark.skipif(not EVALDATA.is_dir(), reason="../shared/evaldata is not on this machine")
def test_qasper_questions_are_routed_to_their_own_paper(tmp_path, tiny_llama):
    """Each question naming a word that only its paper uses goes to that paper's cartridge; the many generic ones
    ("What baselines do they compare to?", which any of these papers answers) can't be placed from the question
    alone, so for all questions the bar is having the paper among the top 3 for most of them (chance: 3 in 12)."""
    papers = load_corpora(DEFAULT_DATA, ",".join(map(str, range(12))))
    store = CartridgeStore(tmp_path, tiny_llama)
    for paper in papers:
        store.add(paper.name, Cartridge.from_prefix(tiny_llama, paper.text, 4), corpus=paper.text)
    placeable, in_top3, total, missed = 0, 0, 0, []
    for paper in papers:
        others = [o.text for o in papers if o is not paper]
        for q in paper.questions:
            ranked = [r.name for r in store.route(q.question, k=3)]
            total += 1
            in_top3 += paper.name in ranked
            if only_own_words(q.question, paper.text, others):
                placeable += 1
                if ranked[0] != paper.name:
                    missed.append((q.question, paper.name, ranked[0]))
    assert placeable >= 20 and not missed, missed
    assert in_top3 / total >= 0.6, (in_top3, total)


def test_routing_needs_a_corpus_text(tmp_path, tiny_llama):
    store = CartridgeStore(tmp_path, tiny_llama)
    store.add("bare", Cartridge.from_prefix(tiny_llama, CORPORA["orchard"], 12))
    with pytest.raises(ConfigError, match=r"has a corpus text \(.corpus.txt\) to route by"):
        store.route("apple")
    (tmp_path / "bare.corpus.txt").write_text(CORPORA["orchard"])
    store.refresh()  # a corpus text dropped in is picked up
    assert store.route("apple")[0].name == "bare"
    store.add("other", Cartridge.from_prefix(tiny_llama, CORPORA["railway"], 12), corpus=CORPORA["railway"])
    assert store.route("slate trains")[0].name == "other"
    (tmp_path / "bare.corpus.txt").write_text(CORPORA["orchard"] + " Slate trains stop here, slate trains.")
    store.refresh()  # and an edited one is read again
    assert store.route("slate trains")[0].name == "bare"


def test_a_new_process_reads_the_catalog_instead_of_every_header(store, tiny_llama, tiny_qwen, monkeypatch):
    """serve/catalog.py: a store opened on a folder whose catalog is current reads no cartridge header; a file
    replaced since is read again; a catalog made for another model, or a damaged one, is not used."""
    from cartridges_sdk import cartridge as cartridge_module
    from cartridges_sdk.serve.catalog import CATALOG

    store.save_catalog()
    read = []  # the headers read to check a file (a cartridge served is read whole, not counted)
    real = cartridge_module.read_file
    monkeypatch.setattr(cartridge_module, "read_file",
                        lambda path, data=True: (read.append(path.name) if not data else None) or real(path, data=data))
    again = CartridgeStore(store.root, tiny_llama)
    assert read == [] and again.names() == store.names() and again.records() == store.records()
    assert again.get("orchard").num_tokens == 12  # serving reads and checks the file itself
    # replaced after the catalog was written: its new header is read, and its new size seen
    Cartridge.from_prefix(tiny_llama, CORPORA["railway"], 20).save(store.root / "railway.safetensors")
    read.clear()
    third = CartridgeStore(store.root, tiny_llama)
    assert read == ["railway.safetensors"] and third._entries["railway"].num_tokens == 20
    # another model's store trusts none of it: it reads the headers and refuses the files
    read.clear()
    assert CartridgeStore(store.root, tiny_qwen).names() == [] and len(read) == 3
    (store.root / CATALOG).write_text("{not json")
    read.clear()
    assert CartridgeStore(store.root, tiny_llama).names() == store.names() and len(read) == 3


def test_the_memory_budget_costs_each_cartridge_once():
    """Recent sums the costs it holds as they come and go (summing them again at every put read a store of n
    cartridges in n^2 / 2 cost calls)."""
    from cartridges_sdk.kv import Recent

    calls = []
    held = Recent(budget=10, cost=lambda v: calls.append(v) or v)
    for i, cost in enumerate([4, 4, 4, 9, 1]):
        held.put(i, cost)
    assert list(held) == [3, 4] and len(calls) == 5
    held.put(3, 2)  # the same key again: its old cost goes
    assert list(held) == [4, 3] and held._total == 3
    held.pop(4)
    held.clear()
    assert held._total == 0 and list(held) == []


def test_routing_ranks_only_the_best_and_breaks_ties_by_name():
    import numpy as np

    from cartridges_sdk.serve.store import _best

    names = ["delta", "alpha", "gamma", "beta", "eps"]
    scores = np.array([2.0, 1.0, 0.0, 1.0, 3.0], dtype=np.float32)
    assert _best(names, scores, 1) == [("eps", 3.0)]
    assert _best(names, scores, 3) == [("eps", 3.0), ("delta", 2.0), ("alpha", 1.0)]  # beta ties alpha: by name
    assert _best(names, scores, 10) == [("eps", 3.0), ("delta", 2.0), ("alpha", 1.0), ("beta", 1.0)]  # no zero
    assert _best(names, np.zeros(5), 2) == []


def test_a_quick_refresh_sees_new_and_renamed_over_files_at_once_and_rewritten_ones_at_the_next_full_scan(
        store, tiny_llama, monkeypatch):
    """A server's once-a-second look compares inodes from the folder's listing (no stat per file): what sync and
    store.add write (a new file renamed into place) shows at once; a file rewritten in place keeps its inode and
    shows at the next full scan (`FULL_SCAN_SECONDS`)."""
    from cartridges_sdk.serve import store as store_module

    store.refresh()  # a full scan: the quick ones that follow compare inodes
    Cartridge.from_prefix(tiny_llama, CORPORA["orchard"], 8).save(store.root / "cider.safetensors")
    Cartridge.from_prefix(tiny_llama, CORPORA["railway"], 20).save(store.root / "railway.safetensors")
    assert store.refresh(quick=True)["added"] == ["cider"] and store._entries["railway"].num_tokens == 20
    in_place = Cartridge.from_prefix(tiny_llama, CORPORA["lighthouse"], 16)
    in_place.save(store.root / "scratch.safetensors")
    with open(store.root / "lighthouse.safetensors", "r+b") as f:  # rewritten in place: the same inode
        f.write((store.root / "scratch.safetensors").read_bytes())
        f.truncate()
    (store.root / "scratch.safetensors").unlink()
    store.refresh(quick=True)
    assert store._entries["lighthouse"].num_tokens == 12  # not compared yet
    monkeypatch.setattr(store_module, "FULL_SCAN_SECONDS", 0.0)
    store.refresh(quick=True)
    assert store._entries["lighthouse"].num_tokens == 16 and store.get("lighthouse").num_tokens == 16


def test_forgetting_or_removing_a_cartridge_leaves_nothing_of_it_in_the_catalog(store):
    """The catalog holds each cartridge's record (a patient's name may be its subject): deleting a cartridge deletes
    the catalog, and the next sync writes it again without it."""
    from cartridges_sdk.serve.catalog import CATALOG

    store.save_catalog()
    assert "orchard" in (store.root / CATALOG).read_text()
    store.remove("orchard")
    assert not (store.root / CATALOG).exists()
    store.save_catalog()
    store.forget("railway")
    assert not (store.root / CATALOG).exists()
    store.save_catalog()
    text = (store.root / CATALOG).read_text()
    assert "lighthouse" in text and "orchard" not in text and "railway" not in text


def test_a_catalog_edited_by_hand_is_read_afresh_where_it_does_not_fit(store, tiny_llama):
    import json

    from cartridges_sdk.serve.catalog import CATALOG

    store.save_catalog()
    data = json.loads((store.root / CATALOG).read_text())
    data["entries"]["orchard.safetensors"]["num_tokens"] = "many"
    data["entries"]["railway.safetensors"] = ["not", "an", "entry"]
    (store.root / CATALOG).write_text(json.dumps(data))
    again = CartridgeStore(store.root, tiny_llama)
    assert again.names() == store.names() and again._entries["orchard"].num_tokens == 12
