"""The Lightning data module of draft distillation: prompt + response sequences, length-bucketed, sharded by batch.

Sources: `target` reads the generate stage's shards (the target's own answers, on-policy, optionally with its
top-k logprobs per response token); `dataset` tokenises the prompt split's `reference` answers the way the
generate stage does (`dataset_responses`), the fixed off-policy baseline.

Batch (a dict of tensors), B sequences right-padded to T:
- `input_ids` Long[B, T] (pad_id on padding), `attention_mask` Long[B, T] (1 on real tokens);
- `loss_mask` Bool[B, T]: True at t iff the logits at t predict a response token, prompt_len-1 <= t <= length-2;
- `labels` Long[B, T]: input_ids[:, t+1] where loss_mask, else -100;
- `prompt_len` Long[B], `length` Long[B] (after truncation);
- with top-k shards: `topk_ids` Long[B, T, k] / `topk_logprobs` Float[B, T, k], row t the target's top-k for
  token t+1 at loss positions; 0 / -inf elsewhere (mask before reducing, or -inf * 0 gives NaN).
- with a features store (train split, `features_dir`): `features` [B, T, F] the target's hidden states (zero on
  padding) and the store's top-k in the layout above (core/data/features.py).

Truncation to max_length keeps the prompt's LAST tokens (the turn being answered and the template's generation
prompt) and the response's FIRST tokens, so the response's own prefix stays intact and top-k rows keep their
response index: response tokens kept r' = min(r, max(max_length - p, max_length // 2), max_length - 1), prompt
tokens kept p' = min(p, max_length - r'). Hence at least min(r, max_length // 2) response tokens and at least one
prompt token (the position that predicts the first response token) survive.

Batching: rows are cut into length buckets so batches carry little padding. Train, per epoch: shuffle rows
(seeded by seed and epoch), sort each chunk of bucket_size * batch_size rows by length, cut it into batches,
shuffle the batch order. Val: sorted by length, never shuffled. Sharding is by whole batch and done here (the
trainer runs with use_distributed_sampler=False): train pads the batch list by repeating from its start so every
rank runs the same number of steps (DDP needs equal counts); val gives rank r batches r, r+W, ... with no repeats,
so per-rank sums add up to a single-process pass exactly (ranks may hold unequal counts: reduce at epoch end).

Epochs: the loader's sampler has `set_epoch`, which Lightning's fit loop calls at every epoch start, so no
`reload_dataloaders_every_n_epochs` is needed (it works too: a rebuilt loader starts at trainer.current_epoch).
The sampler yields each batch's row indices and the dataset turns them into tensors, so persistent workers see
the new epoch's plan without being rebuilt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from specdistill.core.data.generation import dataset_responses
from specdistill.core.errors import DataError

log = logging.getLogger(__name__)

# draft / mix read the target's shards for their prompts; the module replaces responses with the
# draft's own samples (all of them, or a fraction mix_lambda of the batches): training/onpolicy.py
SOURCES = ("target", "dataset", "draft", "mix")
TOPK_COLUMNS = ("topk_ids", "topk_logprobs")


@dataclass
class DataConfig:
    source: str = "target"  # target: the generate stage's shards (on-policy) | dataset: the split's references
    batch_size: int = 8  # sequences per batch
    max_length: int = 768  # prompt + response tokens kept (see the module docstring for which)
    bucket_size: int = 16  # batches per length bucket
    num_workers: int = 0
    seed: int = 0
    max_response_tokens: int = 256  # source=dataset: cap on the tokenised reference (like generate.max_new_tokens)
    # validation data: on-policy by default whatever `source` trains on, so runs that differ in their
    # training data are measured on the same tokens (the target's own answers, what the decoder will see)
    val_source: str = "target"
    mix_lambda: float = 0.5  # source=mix: the fraction of batches whose answers the draft samples itself
    # the first fraction of the train split's rows (those with a response, in the split's order): a data curve's
    # smaller sizes (a `methods.<m>.data` key of a variant item); validation stays whole
    train_fraction: float = 1.0
    RANGES: ClassVar[dict[str, str]] = {"batch_size": "[1, inf)", "max_length": "[2, inf)", "bucket_size": "[1, inf)",
                                        "num_workers": "[0, inf)", "max_response_tokens": "[1, inf)",
                                        "mix_lambda": "[0, 1]", "train_fraction": "(0, 1]"}  # checked by `section`

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for key, allowed in (("source", SOURCES), ("val_source", ("target", "dataset"))):
            if getattr(self, key) not in allowed:
                raise DataError(f"data.{key}={getattr(self, key)!r}: use one of {allowed}")
        if not 0 <= self.mix_lambda <= 1:
            raise DataError(f"data.mix_lambda={self.mix_lambda} must be in [0, 1]")
        if not 0 < self.train_fraction <= 1:
            raise DataError(f"data.train_fraction={self.train_fraction} must be in (0, 1]: the share of the train rows "
                            "kept")
        if self.batch_size < 1 or self.bucket_size < 1 or self.max_response_tokens < 1 or self.num_workers < 0:
            raise DataError("data.batch_size, bucket_size and max_response_tokens must be >= 1, num_workers >= 0")
        if self.max_length < 2:
            raise DataError(f"data.max_length={self.max_length}: a sequence needs a prompt and a response token")


def truncated_lengths(prompt_len: np.ndarray, length: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, response tokens) kept of each row under max_length; the rule is in the module docstring."""
    resp = length - prompt_len
    r = np.minimum(resp, np.minimum(np.maximum(max_length - prompt_len, max_length // 2), max_length - 1))
    return np.minimum(prompt_len, max_length - r), r


def kept_spans(ds: Any, max_length: int, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices of the rows with a response, their kept prompt and response spans under max_length): the one
    row selection the data module and the features stage share, so a stored row is exactly a batch row."""
    import pyarrow.compute as pc

    length = pc.list_value_length(ds.data.column("input_ids")).to_numpy().astype(np.int64)
    prompt_len = ds.data.column("prompt_len").to_numpy().astype(np.int64)
    bad = np.flatnonzero((prompt_len < 1) | (prompt_len > length))
    if len(bad):
        raise DataError(f"{where}: {len(bad)} row(s) with prompt_len outside [1, len(input_ids)], "
                        f"first {ds[int(bad[0])]['id']!r}")
    # a row without response tokens has nothing to learn from and would only add padding
    keep = np.flatnonzero(length > prompt_len)
    return (keep, *truncated_lengths(prompt_len[keep], length[keep], max_length))


def plan_batches(lengths: np.ndarray, batch_size: int, bucket_size: int | None, seed: int = 0,
                 epoch: int = 0) -> list[list[int]]:
    """Row indices of each batch. bucket_size=None: the whole set sorted by length, in order (val)."""
    n = len(lengths)
    if bucket_size is None:
        order = np.argsort(lengths, kind="stable")
        return [order[i:i + batch_size].tolist() for i in range(0, n, batch_size)]
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n)
    chunk = bucket_size * batch_size
    batches = []
    for c in range(0, n, chunk):
        rows = perm[c:c + chunk]
        rows = rows[np.argsort(lengths[rows], kind="stable")]
        batches += [rows[i:i + batch_size].tolist() for i in range(0, len(rows), batch_size)]
    # without this every bucket would run short-to-long, a length curriculum inside each epoch
    return [batches[i] for i in rng.permutation(len(batches))]


def shard_batches(batches: list[list[int]], world_size: int, rank: int, even: bool) -> list[list[int]]:
    """Rank `rank`'s batches: r, r+W, ...; even=True first pads the list by repeating it from its start."""
    if even and batches:
        total = -(-len(batches) // world_size) * world_size
        batches = [batches[i % len(batches)] for i in range(total)]
    return batches[rank::world_size]


def load_split(folder: Path) -> Any:
    """A saved `datasets.Dataset`, or None if it has no rows (`load_from_disk` fails on those)."""
    import datasets

    try:
        if not json.loads((folder / "state.json").read_text()).get("_data_files"):
            return None
        return datasets.load_from_disk(str(folder))
    except (OSError, ValueError, IndexError) as e:
        raise DataError(f"cannot read {folder} ({e}): run its stage again") from e


class BatchPlanSampler(Sampler[list[int]]):
    """Yields one rank's batches (lists of row indices) of an epoch; Lightning calls set_epoch each epoch.

    `skip` batches of the first epoch iterated are left out: a run resumed mid-epoch continues at the batch the
    killed run reached (the plan is a function of seed and epoch), so it trains on what one unbroken run would.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, bucket_size: int | None, seed: int, world_size: int,
                 rank: int, epoch: int = 0, skip: int = 0) -> None:
        self.lengths, self.batch_size, self.bucket_size, self.seed = lengths, batch_size, bucket_size, seed
        self.world_size, self.rank, self.epoch, self.skip = world_size, rank, epoch, skip

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # the skip belongs to the epoch the run resumed in
            self.skip = 0
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        plan = plan_batches(self.lengths, self.batch_size, self.bucket_size, self.seed, self.epoch)
        return shard_batches(plan, self.world_size, self.rank, even=self.bucket_size is not None)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        return iter(self.batches()[skip:])

    def __len__(self) -> int:
        n = -(-len(self.lengths) // self.batch_size)  # the plan's batch count does not depend on the epoch
        if self.bucket_size is None:
            return len(range(self.rank, n, self.world_size))
        return -(-n // self.world_size)


def next_token_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """labels[b, t] = input_ids[b, t + 1] where position t is scored, else -100."""
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = torch.where(loss_mask[:, :-1], input_ids[:, 1:], -100)
    return labels


class SequenceBatches(Dataset):
    """Item = a list of row indices -> the collated batch (DataLoader(batch_size=None) with BatchPlanSampler)."""

    def __init__(self, ds: Any, prompt_kept: np.ndarray, response_kept: np.ndarray, pad_id: int,
                 store: Any = None) -> None:
        self.ds, self.pad_id, self.store = ds, pad_id, store  # store: data/features.FeatureStore
        self.prompt_kept, self.response_kept = prompt_kept, response_kept
        self.has_topk = store is not None or all(c in ds.column_names for c in TOPK_COLUMNS)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = list(rows)
        data = self.ds[rows]
        pk, rk = self.prompt_kept[rows], self.response_kept[rows]
        lengths = pk + rk
        b, t = len(rows), int(lengths.max())
        input_ids = torch.full((b, t), self.pad_id, dtype=torch.long)
        attention = torch.zeros((b, t), dtype=torch.long)
        loss_mask = torch.zeros((b, t), dtype=torch.bool)
        stored = [self.store.row(data["id"][i], int(pk[i]), int(rk[i])) for i in range(b)] if self.store else None
        if self.has_topk:
            k = stored[0][1].shape[-1] if stored else len(data["topk_ids"][0][0])
            topk_ids = torch.zeros((b, t, k), dtype=torch.long)
            topk_lp = torch.full((b, t, k), float("-inf"), dtype=torch.float32)
        if stored:
            features = torch.zeros((b, t, stored[0][0].shape[-1]), dtype=stored[0][0].dtype)
        for i in range(b):
            p, r, full_p = int(pk[i]), int(rk[i]), int(data["prompt_len"][i])
            seq = data["input_ids"][i]
            input_ids[i, :p + r] = torch.tensor(seq[full_p - p:full_p + r], dtype=torch.long)
            attention[i, :p + r] = 1
            loss_mask[i, p - 1:p + r - 1] = True
            if stored:  # the features stage's pass over exactly this span (core/data/features.py)
                features[i, :p + r] = stored[i][0]
                topk_ids[i, p - 1:p + r - 1] = stored[i][1].long()
                topk_lp[i, p - 1:p + r - 1] = stored[i][2].float()
            elif self.has_topk:
                # row j of the shard is the distribution of response token j, predicted at position p-1+j
                ids, lp = data["topk_ids"][i], data["topk_logprobs"][i]
                if len(ids) < r or len(lp) < r:
                    raise DataError(f"row {data['id'][i]!r}: {len(ids)} top-k rows for {r} response tokens")
                topk_ids[i, p - 1:p + r - 1] = torch.tensor(ids[:r], dtype=torch.long)
                topk_lp[i, p - 1:p + r - 1] = torch.tensor(lp[:r], dtype=torch.float32)
        batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
                 "labels": next_token_labels(input_ids, loss_mask),
                 "prompt_len": torch.as_tensor(pk, dtype=torch.long),
                 "length": torch.as_tensor(lengths, dtype=torch.long)}
        if self.has_topk:
            batch["topk_ids"], batch["topk_logprobs"] = topk_ids, topk_lp
        if stored:
            batch["features"] = features
        return batch


class DistillDataModule(pl.LightningDataModule):
    """Train / val batches for distillation from the generate stage's shards or the prompt split's references."""

    def __init__(self, cfg: DataConfig, generated_dir: str | Path, prompts_dir: str | Path, tokenizer: Any = None,
                 pad_id: int = 0, world_size: int | None = None, rank: int | None = None,
                 features_dir: str | Path | None = None) -> None:
        super().__init__()
        cfg.validate()
        if "dataset" in (cfg.source, cfg.val_source) and tokenizer is None:
            raise DataError("data.source=dataset tokenises the references: pass the target's tokenizer")
        self.cfg, self.tokenizer, self.pad_id = cfg, tokenizer, pad_id
        self.generated_dir, self.prompts_dir = Path(generated_dir), Path(prompts_dir)
        self._world_size, self._rank = world_size, rank  # overrides for tests; else from the trainer
        # precomputed target features and top-k for the train split (EAGLE, distill.teacher=precomputed);
        # validation always runs the target live, so its figures are exact over the full vocabulary
        self.features_dir = None if features_dir is None else Path(features_dir)
        if self.features_dir is not None and cfg.source != "target":
            raise DataError(f"precomputed features exist for the generate stage's answers only: distill.data.source="
                            f"{cfg.source} needs distill.teacher=live")
        self.splits: dict[str, SequenceBatches] = {}

    # --- loading ---------------------------------------------------------------------------------

    def _load_generated(self, split: str) -> Any:
        import datasets

        folder = self.generated_dir / split
        shards = sorted(p for p in folder.glob("shard-*") if p.is_dir()) if folder.is_dir() else []
        if not shards:
            raise DataError(f"no generated shards in {folder}: run the generate stage first (dvc repro generate)")
        parts = [d for d in map(load_split, shards) if d is not None]
        if not parts:
            raise DataError(f"the {split} split of data.source=target is empty ({folder})")
        if len({tuple(sorted(p.column_names)) for p in parts}) > 1:
            raise DataError(f"the shards in {folder} have different columns: regenerate them (dvc repro generate)")
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    def _load_references(self, split: str) -> Any:
        import datasets

        folder = self.prompts_dir / split
        if not folder.is_dir():
            raise DataError(f"prompt split {folder} is missing: run the prepare stage first (dvc repro prepare)")
        rows = load_split(folder)
        if rows is None:
            raise DataError(f"the {split} split of data.source=dataset is empty ({folder})")
        prompts = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
        responses = dataset_responses(self.tokenizer, list(rows["reference"]), self.cfg.max_response_tokens)
        return datasets.Dataset.from_dict({
            "id": list(rows["id"]),
            "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
            "prompt_len": [len(p) for p in prompts],
        })

    def _build(self, split: str) -> SequenceBatches:
        source = self.cfg.val_source if split == "val" else self.cfg.source
        ds = self._load_references(split) if source == "dataset" else self._load_generated(split)
        keep, pk, rk = kept_spans(ds, self.cfg.max_length, split)
        if len(keep) < len(ds):
            log.warning("%s: dropping %d row(s) with an empty response", split, len(ds) - len(keep))
        if split == "train" and self.cfg.train_fraction < 1:  # the first rows: a smaller size holds no other row
            n = max(1, round(len(keep) * self.cfg.train_fraction))
            keep, pk, rk = keep[:n], pk[:n], rk[:n]
        if len(keep) < len(ds):
            ds = ds.select(keep)
        if len(ds) == 0:
            raise DataError(f"the {split} split of data source {source} is empty")
        store = None
        if split == "train" and self.features_dir is not None:
            from specdistill.core.data.features import FeatureStore

            store = FeatureStore(self.features_dir, split)
        return SequenceBatches(ds, pk, rk, self.pad_id, store)

    def setup(self, stage: str | None = None) -> None:
        for split in ("train", "val"):
            if split not in self.splits:
                self.splits[split] = self._build(split)

    # --- loaders ---------------------------------------------------------------------------------

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        world = self._world_size if self._world_size is not None else (trainer.world_size if trainer else 1)
        rank = self._rank if self._rank is not None else (trainer.global_rank if trainer else 0)
        if not 0 <= rank < world:
            raise DataError(f"rank {rank} outside a world of {world}")
        return world, rank

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.splits:
            self.setup()
        data = self.splits[split]
        world, rank = self._world()
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        # batches of this epoch a restored checkpoint already trained on (checkpoints follow a validation, after
        # Lightning counted the batch); Lightning's own fetcher resumes its count there too
        loop = self.trainer.fit_loop if train and self.trainer is not None else None
        done = loop.epoch_loop.batch_progress.current.completed if loop is not None and loop.restarting else 0
        sampler = BatchPlanSampler(data.prompt_kept + data.response_kept, self.cfg.batch_size,
                                   self.cfg.bucket_size if train else None, self.cfg.seed, world, rank, epoch, done)
        return DataLoader(data, batch_size=None, sampler=sampler, num_workers=self.cfg.num_workers,
                          persistent_workers=self.cfg.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def response_tokens(self, split: str = "train", chunk: int = 256) -> Iterator[list[int]]:
        """Each row's response tokens as the loss sees them (after truncation), e.g. to pick a draft vocabulary."""
        self.setup()
        data = self.splits[split]
        ds = data.ds.select_columns(["input_ids", "prompt_len"])  # never pull the wide top-k columns
        for start in range(0, len(ds), chunk):
            rows = ds[start:start + chunk]
            for i, (seq, p) in enumerate(zip(rows["input_ids"], rows["prompt_len"], strict=True)):
                yield seq[p:p + int(data.response_kept[start + i])]

    @property
    def stored_layers(self) -> list[int] | None:
        """The HiddenTap layers the train split's features store holds (None: no store, the target runs live)."""
        self.setup()
        store = self.splits["train"].store
        return None if store is None else store.layers

    @property
    def num_train_tokens(self) -> int:
        """Loss positions in one pass over the whole train split (all ranks, before the train padding)."""
        self.setup()
        return int(self.splits["train"].response_kept.sum())

    @property
    def num_val_tokens(self) -> int:
        """Loss positions of the whole val split: what the ranks' val passes sum to."""
        self.setup()
        return int(self.splits["val"].response_kept.sum())
