"""The medical-record bot's data and benchmark: synthetic records (clinosim) whose questions' right options come from
the structured data and can be read in the record text, and `benchmarks.medical` end to end on a tiny model. The app
itself (a real server with two clinicians' keys) runs as its README's first command in tests/test_docs_commands.py;
the server's access control is tests/test_access.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cartridges_sdk.serve.documents import read_documents

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "medical_records"))

import records  # noqa: E402


@pytest.fixture(scope="module")
def patients():
    return records.simulate(4, seed=0)


def test_every_question_is_answered_by_its_own_record_and_no_option_repeats(patients):
    assert len({p.name for p in patients}) == 4 and all(p.name.startswith("patient-pop-") for p in patients)
    kinds = set()
    for p in patients:
        assert "synthetic" in p.text.splitlines()[0] and p.display_name in p.text
        assert len(p.questions) >= 6
        for q in p.questions:
            kinds.add(q["kind"])
            options = q["question"].splitlines()[1:]
            assert [o[:3] for o in options] == ["A. ", "B. ", "C. ", "D. "]
            texts = [o[3:] for o in options]
            assert len(set(texts)) == 4 and texts["ABCD".index(q["gold"])] == q["right"]
            assert q["right"].lower().removeprefix("dr. ") in p.text.lower(), (p.name, q)
            assert p.display_name in q["ask"] and q["question"].startswith(q["ask"])
            # a wrong option is not in the record as this kind's fact (birth dates and conditions are checkable)
            if q["kind"] in ("birth date", "condition"):
                assert not any(t.lower() in p.text.lower() for t in texts if t != q["right"]), (p.name, q)
    assert {"birth date", "condition", "home dose", "attending", "complaint", "allergy"} <= kinds


def test_the_records_are_laid_out_one_folder_per_patient(patients, tmp_path):
    folder = records.lay_out(patients, tmp_path / "records")
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in patients)
    assert (folder / patients[0].name / "record.txt").read_text() == records.front_matter(patients[0]) + patients[0].text
    # each record says whose it is: synced, its cartridge carries the patient's name as its subject
    documents, skipped = read_documents(folder, unit="folder")
    assert not skipped and {d.name: d.subject for d in documents} == {p.name: p.display_name for p in patients}
    with pytest.raises(ValueError, match="must be from 1 to"):
        records.simulate(0)
    assert records.simulate(2) == tuple(p for p in patients if p.name in {q.name for q in records.simulate(2)})


@pytest.mark.slow  # compacts two records on the default model (about a minute); the records' own tests stay in the default tier
@pytest.mark.default_model
def test_the_medical_benchmark_on_the_default_model(tmp_path, default_lm):
    from benchmarks import medical

    # the default model: a record (1,600-2,700 of its tokens) fits its context; 2 patients, a question each
    result = medical.run(default_lm, tmp_path, 2, 0, 32, questions=1)
    assert result["patients"] == 2 and result["questions"] == 2
    assert set(result["accuracy"]) == {"none", "record", "cartridge", "rag"}
    assert set(result["accuracy_likeliest"]) == {"none", "record", "cartridge", "rag"}
    assert all(0 <= a <= 1 for a in result["accuracy"].values()) and 0 <= result["routed_right"] <= 1
    assert result["kv_mib_per_request"]["cartridge"] < result["kv_mib_per_request"]["record"]
    # the store holds one cartridge per patient, from their folder
    assert len(list((tmp_path / "store-32").glob("patient-pop-*.safetensors"))) == 2
    assert result["record_tokens"]["min"] > 32 * 4  # the cartridge stands in for a record several times its size
