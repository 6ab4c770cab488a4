"""Tables and figures from the metrics files the evaluate stages write."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from specdistill.core.records import rival_names
from specdistill.methods import describe


def settings(all_metrics: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(evaluated method, dataset, temperature, that setting's per-method summaries), in a stable order."""
    for name, metrics in sorted(all_metrics.items()):
        for dataset, temps in metrics["results"].items():
            for temp, m in temps.items():
                yield name, dataset, temp, m


def branch_of(settings: dict[str, Any]) -> str | None:
    """The companion an evaluate run verified as a branch of its method's tree (eval.branch), or None. Records
    written before eval.branch say `lookup_branch: true` (and, before it served every method, `eagle_lookup`)."""
    legacy = settings.get("lookup_branch", settings.get("eagle_lookup"))
    return settings.get("branch") or ("lookup" if legacy else None)  # a record written before eval.branch


def companion(name: str, settings: dict[str, Any]) -> tuple[str, str]:
    """(family, words) of a companion (a branch or a row beside the method), in its own `describe`'s words, from the
    settings the run recorded."""
    return describe({"method": name, "settings": settings})


def rival(metrics: dict[str, Any], row: str) -> dict[str, Any] | None:
    """A rival's row (eval.rivals) as a record of its own: its method and the settings its draft recorded, so the
    method's `describe` and the tables' draft label read it as they read the run's; None for any other row."""
    found = (metrics["settings"].get("rivals") or {}).get(row)
    return {"method": found["method"], "settings": found} if found else None


def drafted(name: str, metrics: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(row, its name in the tables, the record that describes its draft) for every row a draft of the run `name`
    produced: the method's (`spec`, named after the run) and each rival's (named after its item)."""
    return [("spec", name, metrics), *((r, r, rival(metrics, r)) for r in rival_names(metrics["settings"]))]


def own_label(name: str, metrics: dict[str, Any], quote: str = "") -> str:
    """The head to head's name for a run's own draft: its method's, where the run is named otherwise ("eagle
    (compare's own)"), else the run's."""
    return f"{metrics['method']} ({quote}{name}{quote}'s own)" if metrics.get("method", name) != name else name


def alphas(summary: dict[str, Any]) -> list[float]:
    """alpha_pos1, alpha_pos2, ... of one summary, up to the first position never attempted."""
    out = []
    while f"alpha_pos{len(out) + 1}" in summary:
        out.append(summary[f"alpha_pos{len(out) + 1}"])
    return out


def chained_tau(alpha: list[float]) -> list[float]:
    """tau(K) = 1 + sum_{k<=K} prod_{i<=k} alpha_i for K = 0..len(alpha)."""
    taus, prod = [1.0], 1.0
    for a in alpha:
        prod *= a
        taus.append(taus[-1] + prod)
    return taus
