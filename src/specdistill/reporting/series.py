"""The report's series for `dvc plots show`: every item's curves gathered into one long CSV per view, a column naming
the item, so dvc.yaml declares each view once and names no item (a new method's items appear without an edit there).

- `alpha_by_position.csv`: item, setting, method, position, alpha (each evaluate item's `alpha_by_position.csv`);
- `val_alpha.csv`: item, series (T=1 | T=0), step, alpha (each train item's validation passes, `val.csv`);
- `online_alpha.csv`: item, series (frozen | online), request, alpha (each online item's moving window, `curve.csv`).
"""

from __future__ import annotations

import csv
from pathlib import Path

VIEWS = {  # file -> (the per-item file it gathers, the item folders' prefix, {its column: the series it becomes})
    "alpha_by_position.csv": ("alpha_by_position.csv", "", None),
    "val_alpha.csv": ("val.csv", "train_", {"alpha": "T=1", "alpha_t0": "T=0"}),
    "online_alpha.csv": ("curve.csv", "online_", {"frozen_window": "frozen", "online_window": "online"}),
}


def write_series(plots_dir: Path, out: Path) -> list[str]:
    """Gather what every item under `plots_dir` drew into `out`/<view>; the views written (none without items)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for view, (source, prefix, columns) in VIEWS.items():
        rows = []
        for path in sorted(plots_dir.glob(f"{prefix}*/{source}")):
            with open(path, newline="") as fh:
                for row in csv.DictReader(fh):
                    rows += _long(path.parent.name, row, columns)
        if rows:
            with open(out / view, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
            written.append(view)
    return written


def _long(item: str, row: dict[str, str], columns: dict[str, str] | None) -> list[dict[str, str]]:
    """One row per series: the item's own rows as they are, or a wide row split into (series, x, alpha) rows."""
    if columns is None:
        return [{"item": item, **row}]
    x = next(iter(row))  # the first column is the x axis (step, request)
    return [{"item": item, "series": name, x: row[x], "alpha": row[col]}
            for col, name in columns.items() if row.get(col) not in (None, "")]
