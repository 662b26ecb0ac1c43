"""The run's results as a markdown table and two PNG plots: quality against KV memory per method (the paper's
frontier) and decode throughput against the number of concurrent users."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cartridges_sdk.errors import ConfigError

from .methods import METHODS

MIB = 2**20


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _label(row: dict[str, Any]) -> str:
    return METHODS[row["method"]] + (f", p={row['p']}" if row["p"] else "")


def markdown(result: dict[str, Any]) -> str:
    model, prof = result["model"], result["profile"]
    lines = [
        (f"Model {model['name']} ({model['dtype']}), profile `{prof['name']}`, seed {result['seed']}, commit "
        f"{result['commit']}{' (uncommitted changes)' if result['dirty'] else ''}; {result['machine']['cpus']} CPUs; "
        f"run took {result['seconds'] / 60:.1f} min."),
        "",
    ]
    for c in result["corpora"]:
        mc = c["multiple_choice"]
        lines += [
            f"### {c['name']}: {c['tokens']:,} tokens, {c['questions']} questions",
            "",
            f"NLL per answer token: no context {c['nll_none']:.3f}, ICL {c['nll_icl']:.3f}. "
            + (f"Multiple-choice chance: {c['chance']:.2f}. " if mc else "")
            + (f"MMLU ({result['mmlu']['questions']} questions, chance 0.25) with no cartridge: "
               f"{result['mmlu']['none']:.3f}. " if result.get("mmlu") else "")
            + (f"Sizes {c['skipped_sizes']} skipped (not smaller than the document). " if c.get("skipped_sizes") else ""),
            "",
            "| method | KV MiB | x smaller than ICL | NLL | closure | KL(ICL‖method) | KL / untrained |"
            + (" MC acc |" if mc else "") + (" MMLU |" if result.get("mmlu") else ""),
            "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if mc else "") + ("---:|" if result.get("mmlu") else ""),
        ]
        for r in c["rows"]:
            smaller = "1" if r["method"] == "icl" else ("–" if not r["kv_bytes"] else f"{1 / r['kv_fraction_of_icl']:.1f}")
            lines.append(
                f"| {_label(r)} | {r['kv_bytes'] / MIB:.1f} | {smaller} | {_f(r['nll'])} | {_f(r['closure'])} | "
                f"{_f(r['kl'])} | {_f(r['kl_vs_untrained'], '.2f')} |"
                + (f" {_f(r['mc_accuracy'], '.2f')} |" if mc else "")
                + (f" {_f(r['mmlu'], '.3f')} |" if result.get("mmlu") else "")
            )
        lines += [
            "",
            (f"Truncated ICL vs untrained cartridge (the same mathematics): largest per-question NLL difference "
            f"{_f(c['max_nll_diff_truncated_vs_untrained'], '.2e')}."),
            "",
            (f"Self-study cost (measured in this run: matmul peak {result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s, raw "
             f"batched decode where synthesis decodes {result['raw_decode_tokens_per_s']:.1f} tokens/s):"),
            "",
            ("| method | synthesis s | tokens generated | tokens/s | % of raw decode | training s | training tokens "
             "| tokens/s | GFLOP/s | % of peak |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in c["rows"]:
            if "cost" not in r:
                continue
            k = r["cost"]
            fps = k["training_flops_per_s"]
            synth = k["synthesis_tokens_per_s"]
            lines.append(
                f"| {_label(r)} | {k['synthesis_s']:.0f} | {k['generated_tokens']:,} | {_f(synth, '.1f')} | "
                f"{_f(100 * k['fraction_of_raw_decode'] if synth else None, '.1f')} | {k['training_s']:.0f} | "
                f"{k['training_tokens'] or 0:,} | {_f(k['training_tokens_per_s'], '.0f')} | "
                f"{_f(fps / 1e9 if fps else None, '.1f')} | {_f(100 * k['fraction_of_matmul_peak'] if fps else None, '.1f')} |"
            )
        lines.append("")
    t = result.get("throughput")
    if t:
        lines += [
            (f"### Decode throughput ({t['corpus']}; runtime `{t['runtime']}`; KV budget "
            f"{t['kv_budget_bytes'] / 2**30:g} GiB; {t['prompt_tokens']}-token question, {t['decode_tokens']} decoded tokens)"),
            "",
            "| KV per user | users in budget | tokens/s at that batch | x ICL |",
            "|---|---:|---:|---:|",
        ]
        icl = t["curves"]["icl"]
        icl_best = icl["points"][-1]["tokens_per_s"] if icl["points"] else None
        for name, curve in t["curves"].items():
            best = curve["points"][-1]["tokens_per_s"] if curve["points"] else None
            label = "ICL" if name == "icl" else f"cartridge p={name.split(':')[1]}"
            lines.append(
                f"| {label}: {curve['kv_bytes_per_user'] / MIB:.1f} MiB | {curve['max_batch']} | {_f(best, '.0f')} | "
                f"{_f(best / icl_best if best and icl_best else None, '.1f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("Plots need matplotlib: run `scripts/setup.sh` (or pip install matplotlib).") from None
    written = []
    for c in result["corpora"]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for kind in ("truncated", "untrained", "ntp", "generic", "selfstudy"):
            rows = [r for r in c["rows"] if r["method"] == kind and r["closure"] is not None]
            if rows:
                ax.plot([r["kv_bytes"] / MIB for r in rows], [r["closure"] for r in rows], marker="o", label=METHODS[kind])
        icl = next(r for r in c["rows"] if r["method"] == "icl")
        ax.scatter([icl["kv_bytes"] / MIB], [1.0], marker="*", s=160, color="black", label="ICL", zorder=5)
        ax.axhline(0.0, color="grey", linestyle="--", linewidth=1, label="no context")
        ax.set_xscale("log")
        ax.set_xlabel("KV cache (MiB, log scale)")
        ax.set_ylabel("gap closure (gold-answer NLL)")
        ax.set_title(f"{c['name']} ({result['model']['name']}, {result['profile']['name']})", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"frontier-{c['name']}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    t = result.get("throughput")
    if t:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, curve in t["curves"].items():
            if curve["points"]:
                label = f"ICL ({curve['kv_bytes_per_user'] / MIB:.0f} MiB/user)" if name == "icl" else f"cartridge p={name.split(':')[1]}"
                ax.plot([p["batch"] for p in curve["points"]], [p["tokens_per_s"] for p in curve["points"]],
                        marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"concurrent users (up to what fits {t['kv_budget_bytes'] / 2**30:g} GiB of KV)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"decode throughput, {result['model']['name']}, runtime {t['runtime']}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "throughput.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
