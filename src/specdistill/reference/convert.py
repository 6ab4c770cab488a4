"""Our training data in speculators' offline format: the same sequences, the same target states, read-only on the store.

speculators' trainer (`speculators train --data-path D`) reads a `datasets` folder at D with, per row, `input_ids`,
`loss_mask` (1 on the tokens the loss learns: the response) and `seq_len`, and `D/hidden_states/hs_<row>.safetensors`
with `token_ids` [T] and `hidden_states` [T, n_aux + 1, H]: the aux layers (vLLM's ids, which are HiddenTap indices:
the output of decoder layer k) and then the last layer's output before the final norm (HiddenTap index L), from which
it computes the target's distribution. The draft vocabulary is given as `d2t.npy` / `t2d.npy` (its offsets and mask),
made from ours, so both trainers predict over the same tokens.

Rows are exactly what our train stage trains on (`DistillDataModule` over the features store): the kept prompt and
response spans under `distill.data.max_length`, the store's states for them. speculators needs a validation split
(`--train-data-ratio` in (0, 1)); its validation steers nothing in our use (the last epoch's weights are kept), so
the folder ends with one copy of the first row as that split (`VAL_ROWS`), and `train_ratio` says where it starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdistill.core.errors import DataError
from specdistill.core.io import atomic_path

VAL_ROWS = 1
FORMAT = "speculators-offline-1"  # what `meta.json` names: the layout above


@dataclass(frozen=True)
class Converted:
    folder: Path
    rows: int            # training rows (the validation copy not counted)
    tokens: int          # tokens of the training rows (what speculators packs into its steps)
    loss_tokens: int     # response tokens: what either trainer's loss sees in one pass
    train_ratio: float   # --train-data-ratio: the first `rows` rows train


def row_of(batch: dict[str, torch.Tensor], layers: list[int], aux: list[int], last: int) -> dict[str, torch.Tensor]:
    """One collated row of our data module (batch of 1 with `features`) as speculators' row: token ids, the loss mask
    on the tokens (ours marks the positions that predict them, one earlier) and the states [T, len(aux) + 1, H]."""
    n = int(batch["length"][0])
    ids = batch["input_ids"][0, :n]
    loss_mask = torch.zeros(n, dtype=torch.long)
    loss_mask[1:] = batch["loss_mask"][0, :n - 1].long()  # ours: t predicts t+1; speculators': token t is learned
    feats = batch["features"][0, :n]
    width = feats.shape[-1] // len(layers)
    states = torch.stack([feats[:, layers.index(x) * width:(layers.index(x) + 1) * width] for x in [*aux, last]], 1)
    return {"token_ids": ids.clone(), "loss_mask": loss_mask, "hidden_states": states.contiguous()}


def write_offline(train_rows: Any, layers: list[int], aux: list[int], last: int, d2t: torch.Tensor | None,
                  vocab_size: int, final: str | Path, progress: bool = True) -> Converted:
    """Write `final` (atomically: no half-written folder under its name) from `train_rows`, our SequenceBatches over
    the features store (`layers`: what it holds, in its order); `aux`: the layers the draft fuses; `last`: the final
    norm's input (num_hidden_layers); `d2t`: our draft vocabulary's target ids (None: the full vocabulary)."""
    import datasets
    from safetensors.torch import save_file
    from tqdm import tqdm

    missing = [x for x in [*aux, last] if x not in layers]
    if missing:
        raise DataError(f"the features store holds layers {layers}; speculators' trainer needs {[*aux, last]} "
                        f"(missing {missing}): add them to features.layers and rerun the features stage")
    n = len(train_rows)
    if n == 0:
        raise DataError("no training rows to convert: the train split is empty")
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    tokens = loss_tokens = 0
    with atomic_path(final, is_dir=True) as tmp:
        (tmp / "hidden_states").mkdir()
        for i in tqdm(range(n + VAL_ROWS), desc="speculators format", unit="row", disable=not progress):
            row = row_of(train_rows[[i % n]], layers, aux, last)
            save_file({"token_ids": row["token_ids"], "hidden_states": row["hidden_states"]},
                      str(tmp / "hidden_states" / f"hs_{i}.safetensors"))
            rows["input_ids"].append(row["token_ids"].tolist())
            rows["loss_mask"].append(row["loss_mask"].tolist())
            rows["seq_len"].append(len(row["token_ids"]))
            if i < n:
                tokens += len(row["token_ids"])
                loss_tokens += int(row["loss_mask"].sum())
        ds = datasets.Dataset.from_dict(rows).with_format("torch")  # speculators compares tensors with tensors
        ds.save_to_disk(str(tmp))  # beside hidden_states/: speculators reads both from its --data-path
        if d2t is not None:
            d2t = torch.as_tensor(d2t, dtype=torch.long)
            np.save(tmp / "d2t.npy", (d2t - torch.arange(len(d2t))).numpy())  # speculators stores offsets
            t2d = torch.zeros(vocab_size, dtype=torch.bool)
            t2d[d2t] = True
            np.save(tmp / "t2d.npy", t2d.numpy())
        ratio = (n + 0.5) / (n + VAL_ROWS)  # int(len * ratio) == n: speculators' own split rule
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "rows": n, "val_rows": VAL_ROWS, "tokens": tokens,
                                                   "loss_tokens": loss_tokens, "train_ratio": ratio, "aux": aux,
                                                   "last": last}, indent=1))
    return Converted(Path(final), n, tokens, loss_tokens, ratio)
