"""Medusa's tables in the report's distillation section: per-head accuracy, the trees grown from it, and the
exercises on them (docs/definitions.md), from the train records."""

from __future__ import annotations

from typing import Any


def training_tables(runs: dict[str, dict[str, Any]], evaluated: dict[str, dict[str, Any]]) -> list[str]:
    """Per-head accuracy, the trees grown from it, and exercises 3 and 4 (docs/definitions.md), from measurement."""
    from specdistill.methods.medusa.tree import cartesian_choices, expected_accepted

    lines: list[str] = []
    for name, r in runs.items():
        if "trees" not in r:
            continue
        f, acc, k = r["final"], r["trees"]["acc"], r["settings"]["method"]["num_heads"]
        lines += [f"### Medusa heads (`{name}`): per-head accuracy on the validation data", "",
                  "Head k at position t against the target's top token at t+k (the token k+1 steps ahead); alpha is",
                  "sum min(p, q) at temperature 1 over the full vocabulary.", "",
                  "| head | predicts | top-1 | top-5 | alpha (T=1) |", "|---|---|---|---|---|"]
        lines += [f"| {i} | x(t+{i + 1}) | {f[f'val/head{i}_top1']:.3f} | {f[f'val/head{i}_top5']:.3f} | "
                  f"{f[f'val/head{i}_alpha']:.3f} |" for i in range(1, k + 1)]
        lines += ["", "Trees grown from these accuracies (best-first by path probability, heads taken as independent):",
                  "", "| nodes | depth | candidate sequences (leaves) | expected tau |", "|---|---|---|---|"]
        for b, t in sorted(r["trees"]["trees"].items(), key=lambda kv: int(kv[0])):
            choices = [tuple(c) for c in t["choices"]]
            leaves = sum(1 for c in choices if not any(len(o) == len(c) + 1 and o[:-1] == c for o in choices))
            lines.append(f"| {b} | {max(map(len, choices))} | {leaves} | {t['expected_tau']:.2f} |")
        if k >= 3:
            full = cartesian_choices(3, 3)
            chosen = [tuple(c) for c in min(r["trees"]["trees"].values(), key=lambda t: len(t["choices"]))["choices"]]
            lines += ["", "**Exercise 3** (3 heads, top-3 each): the full cartesian tree has 3^3 = 27 candidate "
                      f"sequences and {len(full)} tree tokens (3 + 9 + 27), for an expected tau of "
                      f"{1 + expected_accepted(full, acc):.2f} under the measured accuracies; the chosen tree spends "
                      f"{len(chosen)} tokens for {1 + expected_accepted(chosen, acc):.2f}."]
        lines += ["", *medusa_memory(r, runs, evaluated), ""]
    return lines


def medusa_memory(medusa: dict[str, Any], runs: dict[str, dict[str, Any]],
                  evaluated: dict[str, dict[str, Any]]) -> list[str]:
    """Exercise 4: the memory of the Medusa heads against the separate draft (parameters; bytes at bf16)."""
    rows = ["**Exercise 4**, memory at bf16 (2 bytes a parameter): what each method adds to the target's 135M.", "",
            "| method | parameters | bytes (bf16) | note |", "|---|---|---|---|"]
    n = medusa["settings"]["draft_parameters"]
    rows.append(f"| Medusa heads | {n / 1e6:.1f}M | {n * 2 / 2**20:.0f} MiB | "
                f"{medusa['settings']['method']['num_heads']} heads, "
                f"vocabulary {medusa['settings'].get('draft_vocab') or 'full'} |")
    for name, r in runs.items():
        if r["settings"]["method"].get("name", "draft") == "draft":
            d = r["settings"]["draft_parameters"]
            rows.append(f"| separate draft `{name}` | {d / 1e6:.1f}M | {d * 2 / 2**20:.0f} MiB | "
                        "includes its own copy of the input embeddings (28M), "
                        "which a deployment could share with the target |")
    return rows


