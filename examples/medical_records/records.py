"""Synthetic patients' records for the medical-record bot: simulated by clinosim (a physiology-driven synthetic-EHR
generator; nobody real), rendered to plain text one file per patient, with multiple-choice questions whose answers
come from the structured data the text was rendered from.

The same seed and count make the same patients, text and questions on every machine (clinosim is pinned in the
project's ``apps`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

LETTERS = "ABCD"
YEAR = ("2024-01-01", "2024-12-31")
MAX_LAB_LINES = 24  # per encounter: the first result of each test (a stay can have hundreds)


@attrs.frozen
class Patient:
    """One patient: the store's name for them, their record as text, and the questions it answers."""

    name: str  # the cartridge's name: patient-<id>
    display_name: str
    text: str
    # {"kind", "question" (with its options A-D), "options", "gold" (a letter), "answer" (gold letter and text),
    #  "ask" (the question without options), "right" (the right option's text)}
    questions: tuple[dict[str, Any], ...]


POPULATION = 40  # the simulated catchment: about 26 patients seen in the year


def simulate(count: int, seed: int = 0) -> tuple[Patient, ...]:
    """`count` synthetic patients (those with the most encounters in a simulated year), with their records and
    questions; the wrong options come from the whole simulated population. A patient's record and questions do not
    depend on `count`. Takes seconds (once per process and seed); prints nothing."""
    everyone = _population(seed)
    if not 1 <= count <= len(everyone):
        raise ValueError(f"count={count} must be from 1 to {len(everyone)} (the patients the simulation made).")
    return tuple(sorted(everyone[:count], key=lambda p: p.name))


@functools.cache
def _population(seed: int) -> tuple[Patient, ...]:
    """Every patient of the simulation, those with the most encounters first."""
    from clinosim.api import SimulatorConfig, run_beta

    logging.getLogger("clinosim").setLevel(logging.ERROR)  # its notes on how each document was made
    config = SimulatorConfig(random_seed=seed, country="US", catchment_population=POPULATION, time_range=YEAR,
                             snapshot_date=YEAR[1])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress lines
        data = run_beta(config)
    staff = {s.staff_id: s for s in data.hospital_roster}
    people: dict[str, list] = defaultdict(list)
    for record in data.patients:
        people[record.patient.patient_id].append(record)
    facts = {pid: _facts(sorted(people[pid], key=lambda r: r.encounters[0].admission_datetime), staff)
             for pid in sorted(people)}
    order = sorted(people, key=lambda pid: (-len(people[pid]), pid))
    return tuple(Patient(f"patient-{pid.lower()}", facts[pid]["name"], _render(facts[pid]),
                         tuple(_questions(facts[pid], facts, staff, random.Random(f"medical-records:{seed}:{pid}"))))
                 for pid in order)


def lay_out(patients: Sequence[Patient], folder: str | Path) -> Path:
    """Each record as ``FOLDER/NAME/record.txt``, under front matter naming the patient: one folder per patient, one
    cartridge per folder (a store's sync with ``unit="folder"``), so a patient's later files join their cartridge.
    Returns the folder."""
    folder = Path(folder)
    for p in patients:
        (folder / p.name).mkdir(parents=True, exist_ok=True)
        (folder / p.name / "record.txt").write_text(front_matter(p) + p.text, "utf-8")
    return folder


def front_matter(patient: Patient) -> str:
    """The record's front matter: the patient's name as its subject, so that a question naming a patient is answered
    from that patient's record or refused, never answered from another's (docs/security.md, "Subjects")."""
    return f"---\nsubject: {patient.display_name}\n---\n"


# ---- the structured facts, as plain values

def _lookup(system: str, code: str | None) -> str:
    from clinosim.codes import lookup

    if not code:
        return ""
    try:
        return lookup(system, code) or code
    except Exception:  # noqa: BLE001 - an unknown code is shown as the code
        return code


def _day(value: Any) -> str:
    return value.strftime("%Y-%m-%d") if value is not None else ""


def _facts(records: list, staff: dict) -> dict[str, Any]:
    p = records[-1].patient
    encounters = []
    for r in records:
        e = r.encounters[0]
        doctor = staff.get(e.attending_physician_id)
        labs: dict[str, Any] = {}
        for lab in sorted(r.lab_results, key=lambda x: x.result_datetime):
            labs.setdefault(lab.lab_name, lab)
        meds = [o for o in r.orders if o.order_type.value == "medication" and ":" not in o.display_name]
        encounters.append({
            "type": e.encounter_type.value, "start": _day(e.admission_datetime), "end": _day(e.discharge_datetime),
            "doctor": doctor.name if doctor else None, "role": doctor.role if doctor else None,
            "specialty": doctor.specialty.replace("_", " ") if doctor else None,
            "complaint": (e.chief_complaint or "").strip().rstrip("."),
            "diagnosis": _lookup("icd-10-cm", r.clinical_diagnosis.discharge_diagnosis_code
                                 or r.clinical_diagnosis.admission_diagnosis_code) if r.clinical_diagnosis else "",
            "labs": [(n, lab.value, lab.unit or "", lab.flag or "") for n, lab in list(labs.items())[:MAX_LAB_LINES]],
            "orders": sorted({f"{o.display_name} {o.dose_quantity:g} {o.dose_unit} {o.route} {o.frequency}"
                              for o in meds if o.dose_quantity is not None}),
            "procedures": sorted({_lookup("cpt", x.procedure_code) for x in r.procedures if x.procedure_code}),
            "discharge_rx": [f"{i['drug_name']} {i['dose']}" for i in (r.discharge_prescription.items
                                                                        if r.discharge_prescription else [])],
        })
    return {
        "id": p.patient_id, "name": p.name.display_name, "sex": p.sex, "born": _day(p.date_of_birth),
        "blood": p.blood_type, "city": f"{p.address.city}, {p.address.state}" if p.address else "",
        "conditions": [(_lookup("icd-10-cm", c.code), _day(c.onset_date)) for c in p.chronic_conditions],
        "allergies": [_lookup("snomed-ct", a.allergen_code) for a in p.allergies if not a.is_nka],
        "home_meds": [(m.drug_name, m.dose, m.route, m.frequency) for m in p.current_medications],
        "encounters": encounters,
    }


def _render(f: dict[str, Any]) -> str:
    lines = [f"Medical record of {f['name']} (patient {f['id']}), synthetic.",
             f"Sex: {f['sex']}. Born {f['born']}. Blood type {f['blood']}. Lives in {f['city']}.", "",
             "Chronic conditions:"]
    lines += [f"- {name}, since {onset}" for name, onset in f["conditions"]] or ["- none recorded"]
    lines += ["", "Allergies: " + (", ".join(f["allergies"]) or "no known allergies") + ".", "", "Home medications:"]
    lines += [f"- {drug} {dose} {route} {freq}" for drug, dose, route, freq in f["home_meds"]] or ["- none"]
    for e in f["encounters"]:
        until = f", discharged {e['end']}" if e["end"] and e["end"] != e["start"] else ""
        lines += ["", f"{e['type'].capitalize()} encounter of {f['name']} on {e['start']}{until}. Attending "
                      f"physician: Dr. {e['doctor']} ({e['specialty']})."]
        if e["complaint"]:
            lines.append(f"Chief complaint: {e['complaint']}.")
        if e["diagnosis"]:
            lines.append(f"Diagnosis: {e['diagnosis']}.")
        if e["labs"]:
            lines.append("Labs: " + "; ".join(f"{n} {v:g} {u}{' (' + fl + ')' if fl else ''}".replace("  ", " ")
                                              for n, v, u, fl in e["labs"]) + ".")
        if e["orders"]:
            lines.append("Medications ordered: " + "; ".join(e["orders"]) + ".")
        if e["procedures"]:
            lines.append("Procedures: " + "; ".join(e["procedures"]) + ".")
        if e["discharge_rx"]:
            lines.append("Discharge prescription: " + "; ".join(e["discharge_rx"]) + ".")
    return "\n".join(lines) + "\n"


# ---- questions: the right option from this patient's facts, the wrong ones from other patients'

def _choice(rng: random.Random, kind: str, question: str, right: str, pool: Sequence[str]) -> dict[str, Any] | None:
    wrong = sorted({w for w in pool if w and w.lower() != right.lower()})
    if not right or len(wrong) < 3:
        return None
    options = rng.sample(wrong, 3) + [right]
    rng.shuffle(options)
    gold = LETTERS[options.index(right)]
    text = question + "".join(f"\n{letter}. {o}" for letter, o in zip(LETTERS, options))
    return {"kind": kind, "question": text, "options": list(LETTERS), "gold": gold, "answer": f"{gold}. {right}",
            "ask": question, "right": right}


def _questions(f: dict[str, Any], everyone: dict[str, dict[str, Any]], staff: dict,
               rng: random.Random) -> list[dict[str, Any]]:
    others = [o for pid, o in everyone.items() if pid != f["id"]]
    name = f["name"]
    out = [_choice(rng, "birth date", f"When was {name} born?", f["born"], [o["born"] for o in others])]
    mine = {c for c, _ in f["conditions"]}
    if mine:
        out.append(_choice(rng, "condition", f"Which of these chronic conditions does {name} have?",
                           rng.choice(sorted(mine)), [c for o in others for c, _ in o["conditions"] if c not in mine]))
    if f["home_meds"]:
        drug, dose, route, freq = rng.choice(f["home_meds"])
        doses = [m[1] for o in others for m in o["home_meds"]] + ["2.5mg", "10mg", "25mg", "50mg", "100mg", "500mg"]
        out.append(_choice(rng, "home dose", f"What dose of {drug} does {name} take at home?", dose, doses))
        mine_drugs = {m[0] for m in f["home_meds"]}
        out.append(_choice(rng, "home medication", f"Which of these medications does {name} take at home?",
                           rng.choice(sorted(mine_drugs)),
                           [m[0] for o in others for m in o["home_meds"] if m[0] not in mine_drugs]))
    visits = [e for e in f["encounters"] if e["doctor"]]
    if visits:
        e = rng.choice(visits)
        out.append(_choice(rng, "attending", f"Who was the attending physician at {name}'s {e['type']} encounter "
                                             f"on {e['start']}?", f"Dr. {e['doctor']}",
                           [f"Dr. {s.name}" for s in staff.values() if s.role == e["role"]]))
    complaints = [e for e in f["encounters"] if e["complaint"]]
    if complaints:
        e = rng.choice(complaints)
        out.append(_choice(rng, "complaint", f"What was {name}'s chief complaint on {e['start']}?", e["complaint"],
                           [x["complaint"] for o in others for x in o["encounters"]]))
    labs = [(e, lab) for e in f["encounters"] for lab in e["labs"]]
    if labs:
        e, (lab, value, unit, _) = rng.choice(labs)
        values = [f"{v:g} {u}".strip() for o in others for x in o["encounters"] for n, v, u, _ in x["labs"] if n == lab]
        out.append(_choice(rng, "lab value", f"What was {name}'s {lab} on {e['start']}?", f"{value:g} {unit}".strip(),
                           values))
    allergy = f["allergies"][0] if f["allergies"] else "No known allergies"
    out.append(_choice(rng, "allergy", f"What is {name} allergic to?", allergy,
                       [a for o in others for a in o["allergies"]] + ["No known allergies", "Penicillin",
                                                                       "Latex", "Peanuts", "Shellfish"]))
    return [q for q in out if q is not None]
