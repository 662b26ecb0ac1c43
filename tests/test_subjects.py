"""Which subject a question names (serve/subjects.py): a patient's name matched the way a clinic writes it, and a
name no subject matches found by its shape alone; and where a subject comes from (front matter, `store.add`)."""

from __future__ import annotations

import pytest

from cartridges_sdk import Cartridge, CartridgeStore, ConfigError, SyncConfig
from cartridges_sdk.serve.documents import front_subject, read_documents
from cartridges_sdk.serve.subjects import named, unknown_name

SUBJECTS = {"patient-ada": "Ada Quill", "patient-ben": "Ben Oduya", "patient-jl": "Jean-Luc O'Neil",
            "patient-may": "Ada May Quillon"}


@pytest.mark.parametrize("question, who", [
    ("When was Ada Quill born?", ["patient-ada"]),
    ("when was ADA QUILL born", ["patient-ada"]),  # any case
    ("What is QUILL, Ada allergic to?", ["patient-ada"]),  # family name first
    ("Quill Ada: current medication?", ["patient-ada"]),
    ("A. Quill's diagnosis?", ["patient-ada"]),  # an initial, a possessive
    ("Does Mrs Quill smoke?", ["patient-ada"]),  # a title and the family name
    ("Tell me about jean-luc o'neil", ["patient-jl"]),
    ("Is Jean-Luc ONeil on warfarin?", ["patient-jl"]),  # the apostrophe left out
    ("Ada Quillon's last visit?", ["patient-may"]),  # a middle name left out
    ("Did Ben Oduya and Ada Quill meet?", ["patient-ada", "patient-ben"]),
    ("When was Ada Smith born?", []),  # the given name alone is not the patient
    ("When was Quill born?", []),  # nor the family name alone, without a title
    ("What is the diagnosis?", []),
])
def test_a_question_names_a_subject_the_way_a_clinic_writes_it(question, who):
    assert named(question, SUBJECTS) == who


@pytest.mark.parametrize("question, stranger", [
    ("When was Cy Marlowe born?", "Cy Marlowe"),
    ("What is MARLOWE, Cy allergic to?", "MARLOWE Cy"),
    ("C. Marlowe's diagnosis?", "C. Marlowe"),
    ("Does Mr Marlowe smoke?", "Marlowe"),
    ("What did Dr Smith prescribe?", None),  # a clinician, not a subject
    ("What did the MRI show on Monday, March 3?", None),  # acronyms, days and months are no one
    ("Who has gout and lives in Tarrow?", None),  # one capitalised word is a place as often as a name
    ("When was cy marlowe born?", None),  # in lower case a name is found only among the key's own subjects
])
def test_a_name_no_subject_matches_is_found_by_its_shape_alone(question, stranger):
    assert named(question, SUBJECTS) == [] and unknown_name(question) == stranger


def test_a_subject_comes_from_front_matter_or_from_store_add(tmp_path, tiny_llama):
    assert front_subject("---\nsubject: Ada Quill\nward: 3\n---\nRecord of Ada Quill.") == "Ada Quill"
    assert front_subject('---\nsubject: "Ben  Oduya"\n---\n') == "Ben Oduya"
    assert front_subject("Record of Ada Quill.\n---\nsubject: x\n---") is None  # only at the top
    with pytest.raises(ValueError, match="subject"):
        front_subject("---\nsubject: 42\n---\n")
    folder = tmp_path / "records"
    (folder / "ada").mkdir(parents=True)
    (folder / "ada" / "record.txt").write_text("---\nsubject: Ada Quill\n---\nDiagnosis: sarcoidosis.")
    (folder / "ada" / "later.txt").write_text("Seen again in May.")
    (folder / "bad").mkdir()
    (folder / "bad" / "record.txt").write_text("---\nsubject:\n---\nNo name.")
    documents, skipped = read_documents(folder, unit="folder")
    assert [(d.name, d.subject) for d in documents] == [("ada", "Ada Quill")]
    assert [s.path for s in skipped] == ["bad"] and "subject" in skipped[0].why
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.sync(folder, SyncConfig(unit="folder"), progress=False)
    assert store.subjects() == {"ada": "Ada Quill"}
    text = "Patient Ben Oduya, born 1974."
    store.add("ben", Cartridge.from_prefix(tiny_llama, text, 4), corpus=text, subject="Ben Oduya")
    assert store.subjects() == {"ada": "Ada Quill", "ben": "Ben Oduya"}
    assert CartridgeStore(tmp_path / "store", tiny_llama).subjects() == store.subjects()  # in the files
    with pytest.raises(ConfigError, match="subject="):
        store.add("cy", Cartridge.from_prefix(tiny_llama, text, 4), subject="  ")
