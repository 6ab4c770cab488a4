"""The distillation data module: loss alignment, top-k placement, truncation, bucketing and rank sharding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch

from specdistill.core.data.datamodule import (
    DataConfig,
    DataError,
    DistillDataModule,
    plan_batches,
    truncated_lengths,
)

PAD = 0


def write_shards(root: Path, split: str, rows: list[dict], per_shard: int = 1000) -> None:
    """rows: {prompt, response[, topk_ids, topk_logprobs]} -> the generate stage's shard layout."""
    for s, start in enumerate(range(0, max(len(rows), 1), per_shard)):
        part = rows[start:start + per_shard]
        cols = {"id": [f"{split}-{start + i}" for i in range(len(part))],
                "input_ids": [r["prompt"] + r["response"] for r in part],
                "prompt_len": [len(r["prompt"]) for r in part]}
        if part and "topk_ids" in part[0]:
            cols["topk_ids"] = [r["topk_ids"] for r in part]
            cols["topk_logprobs"] = [r["topk_logprobs"] for r in part]
        features = None
        if not part:
            features = datasets.Features({"id": datasets.Value("string"),
                                          "input_ids": datasets.Sequence(datasets.Value("int64")),
                                          "prompt_len": datasets.Value("int64")})
        datasets.Dataset.from_dict(cols, features=features).save_to_disk(str(root / split / f"shard-{s:05d}"))


def varied_rows(n: int, seed: int = 0, offset: int = 1000) -> list[dict]:
    """Rows whose first prompt token (offset + i) identifies them; lengths vary from 6 to ~200."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p, r = int(rng.integers(2, 40)), int(rng.integers(1, 160))
        rows.append({"prompt": [offset + i] + [3] * (p - 1), "response": [4] * r})
    return rows


def module(tmp_path: Path, split_rows: dict[str, list[dict]] | None = None, **kw) -> DistillDataModule:
    gen = tmp_path / "generated"
    if split_rows is not None and not gen.exists():
        for split, rows in split_rows.items():
            write_shards(gen, split, rows, per_shard=7)
    cfg_keys = {k: kw.pop(k) for k in list(kw) if k in DataConfig.__dataclass_fields__}
    dm = DistillDataModule(DataConfig(**cfg_keys), gen, tmp_path / "prompts", pad_id=PAD, **kw)
    dm.setup()
    return dm


def row_keys(batches: list[dict]) -> list[int]:
    return [int(x) for b in batches for x in b["input_ids"][:, 0]]


def test_loss_mask_labels_padding_and_topk_alignment(tmp_path):
    topk = {"topk_ids": [[80 + j, 90 + j] for j in range(3)],
            "topk_logprobs": [[-0.1 * (j + 1), -2.0 - j] for j in range(3)]}
    rows = [{"prompt": [5, 6, 7], "response": [8, 9, 10], **topk},
            {"prompt": [11, 12], "response": [13, 14, 15, 16, 17],
             "topk_ids": [[20 + j, 30 + j] for j in range(5)], "topk_logprobs": [[-1.0, -3.0]] * 5}]
    dm = module(tmp_path, {"train": rows, "val": rows}, batch_size=2)
    (batch,) = list(dm.val_dataloader())
    assert batch["input_ids"].shape == (2, 7) and batch["topk_ids"].shape == (2, 7, 2)
    # val is sorted by length: the 6-token row first
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, PAD], [11, 12, 13, 14, 15, 16, 17]]
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0], [1] * 7]
    assert batch["prompt_len"].tolist() == [3, 2] and batch["length"].tolist() == [6, 7]
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["loss_mask"][0].nonzero().flatten().tolist() == [2, 3, 4]
    assert batch["labels"][0].tolist() == [-100, -100, 8, 9, 10, -100, -100]
    assert batch["loss_mask"][1].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    assert batch["labels"][1].tolist() == [-100, 13, 14, 15, 16, 17, -100]
    # labels are the next token wherever the loss is taken
    m = batch["loss_mask"][:, :-1]
    assert torch.equal(batch["labels"][:, :-1][m], batch["input_ids"][:, 1:][m])
    # top-k row t is the distribution of token t+1: response token j sits at prompt_len - 1 + j
    assert batch["topk_ids"][0, 2:5].tolist() == topk["topk_ids"]
    assert torch.allclose(batch["topk_logprobs"][0, 2:5], torch.tensor(topk["topk_logprobs"]))
    assert batch["topk_ids"][1, 1:6, 0].tolist() == [20, 21, 22, 23, 24]
    off = ~batch["loss_mask"]
    assert (batch["topk_ids"][off] == 0).all() and torch.isneginf(batch["topk_logprobs"][off]).all()
    assert batch["topk_logprobs"].dtype == torch.float32
    assert dm.num_val_tokens == 8


def test_truncation_rule_invariants():
    for p in range(1, 30):
        for r in range(1, 30):
            for max_len in (2, 3, 8, 17, 64):
                pk, rk = (int(x[0]) for x in truncated_lengths(np.array([p]), np.array([p + r]), max_len))
                assert 1 <= pk <= p and 1 <= rk <= r and pk + rk <= max_len
                assert rk >= min(r, max_len // 2)
                if p + r <= max_len:
                    assert (pk, rk) == (p, r)
                else:
                    assert pk + rk == max_len


def test_truncation_keeps_alignment(tmp_path):
    prompt, response = list(range(100, 110)), list(range(200, 210))
    rows = [{"prompt": prompt, "response": response, "topk_ids": [[300 + j] for j in range(10)],
             "topk_logprobs": [[-float(j)] for j in range(10)]},
            {"prompt": list(range(400, 420)), "response": [500, 501],
             "topk_ids": [[600], [601]], "topk_logprobs": [[-1.0], [-2.0]]}]
    dm = module(tmp_path, {"train": rows, "val": rows}, max_length=8, batch_size=2)
    (batch,) = list(dm.val_dataloader())
    assert batch["input_ids"].shape[1] == 8 and batch["length"].tolist() == [8, 8]
    # long prompt + long response: the prompt's last 4 and the response's first max_length // 2 = 4 tokens
    long = batch["prompt_len"].tolist().index(4)
    assert batch["input_ids"][long].tolist() == prompt[-4:] + response[:4]
    assert batch["labels"][long][batch["loss_mask"][long]].tolist() == response[:4]
    assert batch["topk_ids"][long, 3:7, 0].tolist() == [300, 301, 302, 303]
    # long prompt + short response: the whole response, the prompt's last 6 tokens
    short = 1 - long
    assert batch["input_ids"][short].tolist() == list(range(414, 420)) + [500, 501]
    assert batch["labels"][short][batch["loss_mask"][short]].tolist() == [500, 501]
    assert batch["topk_ids"][short, 5:7, 0].tolist() == [600, 601]
    m = batch["loss_mask"][:, :-1]
    assert torch.equal(batch["labels"][:, :-1][m], batch["input_ids"][:, 1:][m])
    assert dm.num_train_tokens == 6
    assert list(dm.response_tokens("train", chunk=1)) == [response[:4], [500, 501]]


def test_bucketing_keeps_padding_small_and_covers_every_row_once(tmp_path):
    rows = varied_rows(192)
    dm = module(tmp_path, {"train": rows, "val": rows[:8]}, batch_size=8, bucket_size=8)
    batches = list(dm.train_dataloader())
    assert sorted(row_keys(batches)) == [1000 + i for i in range(192)]
    padded = sum(int((1 - b["attention_mask"]).sum()) for b in batches)
    lengths = dm.splits["train"].prompt_kept + dm.splits["train"].response_kept
    # bucket_size=1 sorts within a batch only: the padding of random batching
    random_pad = sum(8 * lengths[b].max() - lengths[b].sum() for b in plan_batches(lengths, 8, 1, seed=0))
    assert padded < 0.2 * random_pad
    assert sum(int(b["loss_mask"].sum()) for b in batches) == dm.num_train_tokens


def test_two_ranks_partition_val_and_balance_train(tmp_path):
    rows = varied_rows(45, seed=1)  # 45 rows / batch 4: 12 batches, the last one partial
    val = varied_rows(19, seed=2, offset=5000)  # 5 val batches: 3 on rank 0, 2 on rank 1
    mods = [module(tmp_path, {"train": rows, "val": val}, batch_size=4, bucket_size=2, seed=3, world_size=2,
                   rank=r) for r in (0, 1)]
    vals = [list(m.val_dataloader()) for m in mods]
    keys = row_keys(vals[0]) + row_keys(vals[1])
    assert [len(v) for v in vals] == [3, 2]
    assert sorted(keys) == [5000 + i for i in range(19)]  # no duplicates, no drops
    assert sum(int(b["loss_mask"].sum()) for v in vals for b in v) == mods[0].num_val_tokens
    loaders = [m.train_dataloader() for m in mods]
    trains = [list(dl) for dl in loaders]
    assert len(trains[0]) == len(trains[1]) == len(loaders[0]) == 6
    assert set(row_keys(trains[0]) + row_keys(trains[1])) == {1000 + i for i in range(45)}
    # same epoch, same order (a fresh module too); another epoch, another order
    again = module(tmp_path, batch_size=4, bucket_size=2, seed=3, world_size=2, rank=0).train_dataloader()
    assert row_keys(list(again)) == row_keys(trains[0])
    loaders[0].sampler.set_epoch(1)
    epoch1 = row_keys(list(loaders[0]))
    assert epoch1 != row_keys(trains[0]) and len(epoch1) == 6 * 4
    loaders[0].sampler.set_epoch(0)
    assert row_keys(list(loaders[0])) == row_keys(trains[0])


def test_world_rank_and_epoch_from_the_trainer(tmp_path):
    rows = varied_rows(40, seed=4)
    dm = module(tmp_path, {"train": rows, "val": rows}, batch_size=4, bucket_size=2)
    progress = SimpleNamespace(current=SimpleNamespace(completed=3))  # a checkpoint restored 3 batches into epoch 2
    fit_loop = SimpleNamespace(restarting=True, epoch_loop=SimpleNamespace(batch_progress=progress))
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1, current_epoch=2, fit_loop=fit_loop)
    loader = dm.train_dataloader()
    sampler = loader.sampler
    assert (sampler.world_size, sampler.rank, sampler.epoch) == (2, 1, 2)
    assert len(loader) == 5 and len(dm.val_dataloader()) == 5  # Lightning counts the epoch's batches from len
    plan = sampler.batches()
    assert list(sampler) == plan[3:]  # the resumed epoch continues at its 4th batch, once
    assert list(sampler) == plan
    sampler.skip = 3
    sampler.set_epoch(3)  # a skip left for the resumed epoch does not cut the next one
    assert list(sampler) == sampler.batches() != plan
    fit_loop.restarting = False  # a fresh fit (or a reload between epochs) starts at the first batch
    assert list(dm.train_dataloader().sampler) == plan


def test_dataset_source_tokenises_prompt_and_reference(tmp_path, tiny_tokenizer):
    prompts = ["<|im_start|>user\nWrite a poem<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
    refs = ["The sea and the sky.", "Paris is the capital of France. " * 20]
    for split in ("train", "val"):
        datasets.Dataset.from_dict({"id": ["a", "b"], "prompt": prompts, "reference": refs}).save_to_disk(
            str(tmp_path / "prompts" / split))
    cfg = DataConfig(source="dataset", val_source="dataset", batch_size=2, max_response_tokens=12)
    dm = DistillDataModule(cfg, tmp_path / "missing", tmp_path / "prompts", tokenizer=tiny_tokenizer,
                           pad_id=tiny_tokenizer.pad_token_id)
    (batch,) = list(dm.val_dataloader())
    assert "topk_ids" not in batch
    enc = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    short = tiny_tokenizer(refs[0] + tiny_tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    long = tiny_tokenizer(refs[1], add_special_tokens=False)["input_ids"][:12]
    for i, length in enumerate(batch["length"].tolist()):
        seq = batch["input_ids"][i, :length].tolist()
        p = int(batch["prompt_len"][i])
        assert seq[:p] in enc
        resp = seq[p:]
        if resp[-1] == tiny_tokenizer.eos_token_id:  # the short reference ends in eos, the long one is capped
            assert resp == short
        else:
            assert resp == long and len(resp) == cfg.max_response_tokens
    assert dm.num_val_tokens == len(short) + 12


def test_clear_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="data.source"):
        DataConfig(source="teacher")
    with pytest.raises(DataError, match="tokenizer"):
        DistillDataModule(DataConfig(source="dataset"), tmp_path, tmp_path)
    with pytest.raises(DataError, match="dvc repro generate"):
        DistillDataModule(DataConfig(), tmp_path / "nowhere", tmp_path).setup()
    with pytest.raises(DataError, match="dvc repro prepare"):
        DistillDataModule(DataConfig(source="dataset"), tmp_path, tmp_path / "nowhere", tiny_tokenizer).setup()
    rows = [{"prompt": [1, 2], "response": [3]}]
    with pytest.raises(DataError, match="val split .* is empty"):
        module(tmp_path / "empty", {"train": rows, "val": []})
    with pytest.raises(DataError, match="prompt_len"):
        module(tmp_path / "bad", {"train": [{"prompt": [], "response": [3]}], "val": rows})


def test_lightning_fit_reshuffles_each_epoch(tmp_path):
    import lightning.pytorch as pl

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen: dict[int, list[int]] = {}

        def training_step(self, batch, _):
            self.seen.setdefault(self.current_epoch, []).extend(batch["input_ids"][:, 0].tolist())
            return self.w * batch["loss_mask"].sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    rows = varied_rows(24, seed=5)
    dm = DistillDataModule(DataConfig(batch_size=4, bucket_size=2), tmp_path / "generated", tmp_path / "prompts")
    write_shards(tmp_path / "generated", "train", rows)
    write_shards(tmp_path / "generated", "val", rows[:4])
    model = Recorder()
    pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
               num_sanity_val_steps=0, limit_val_batches=0).fit(model, datamodule=dm)
    assert sorted(model.seen[0]) == sorted(model.seen[1]) == [1000 + i for i in range(24)]
    assert model.seen[0] != model.seen[1]


@pytest.mark.parametrize("fraction,kept", [(0.25, 12), (0.5, 24), (1.0, 48)])
def test_train_fraction_keeps_the_first_rows_and_the_whole_val_split(tmp_path, fraction, kept):
    """A data curve's smaller sizes: the first rows of the train split (a smaller size holds no row a larger one
    lacks), an empty answer dropped before counting; validation is the same at every size."""
    rows = varied_rows(49)
    rows[3]["response"] = []  # dropped first: the sizes count rows with an answer
    dm = module(tmp_path, {"train": rows, "val": rows[:8]}, batch_size=4, train_fraction=fraction)
    want = [1000 + i for i in range(49) if i != 3][:kept]
    assert sorted(row_keys(list(dm.train_dataloader()))) == want
    assert len(dm.splits["val"]) == 8 - 1
    with pytest.raises(DataError, match="train_fraction"):
        DataConfig(train_fraction=0.0)
