"""The features stage: its store holds exactly the live target pass, EAGLE trains from it as from the live
target, a killed stage resumes by shard, and a store that does not fit the run is refused at start."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.core.data.datamodule import DataConfig, DataError, DistillDataModule
from specdistill.core.data.features import FeatureStore
from specdistill.core.errors import ConfigError
from specdistill.core.models.hidden import HiddenTap
from specdistill.methods.eagle.model import build_eagle
from specdistill.methods.eagle.training import EagleModule
from specdistill.stages import features as features_stage
from specdistill.stages import train as train_stage
from specdistill.training.losses import build_loss

from .helpers.data import write_split
from .helpers.train import composed, overrides

MAX_LENGTH = 14  # below the longest rows (up to 22 tokens): the stored spans must follow the truncation


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("generated")
    write_split(d / "train", 12, 0, len(tiny_tokenizer))
    write_split(d / "train", 10, 2, len(tiny_tokenizer), shard="shard-00001")  # two shards: resumption is per shard
    write_split(d / "val", 6, 1, len(tiny_tokenizer))
    (d / "FINGERPRINT").write_text("tiny\n")
    return d


def stage_cfg(tmp_path, tiny_target_dir, generated, *extra):
    # every token's top-k (k = the tiny vocabulary) in float32: the stored teacher is the live one exactly
    return composed(*overrides(tmp_path, tiny_target_dir, generated, f"paths.features_dir={tmp_path}/features",
                               "features.layers=[0,1,2]", "features.topk=1000", "features.dtype=float32",
                               f"distill.data.max_length={MAX_LENGTH}", *extra))


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_target_dir, generated):
    tmp = tmp_path_factory.mktemp("store")
    res = features_stage.run(stage_cfg(tmp, tiny_target_dir, generated))
    assert res["this_run"]["shards"] == 2 and res["layers"] == [0, 1, 2]
    return tmp / "features"


def modules(generated, store, tiny_tokenizer):
    kw = dict(pad_id=tiny_tokenizer.pad_token_id, world_size=1, rank=0)
    cfg = DataConfig(batch_size=4, max_length=MAX_LENGTH)
    return (DistillDataModule(cfg, generated, "unused", features_dir=store, **kw),
            DistillDataModule(cfg, generated, "unused", **kw))


def test_the_store_holds_the_live_pass_over_the_kept_span(store, generated, tiny_tokenizer, tiny_model):
    stored, live_module = modules(generated, store, tiny_tokenizer)
    n = 0
    for batch, live in zip(stored.train_dataloader(), live_module.train_dataloader(), strict=True):
        assert torch.equal(batch["input_ids"], live["input_ids"])  # same plan: the store changes no batch
        with HiddenTap(tiny_model, [0, 1, 2]) as tap, torch.no_grad():
            hidden = tiny_model.model(input_ids=batch["input_ids"],
                                      attention_mask=batch["attention_mask"]).last_hidden_state
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(batch["features"][real], tap.concat()[real], atol=1e-5, rtol=1e-5)
        assert not batch["features"][~real].any()
        mask = batch["loss_mask"]
        want = torch.log_softmax(tiny_model.lm_head(hidden[mask]).float(), -1)
        got = torch.full_like(want, float("-inf")).scatter(-1, batch["topk_ids"][mask], batch["topk_logprobs"][mask])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # row t: the distribution of token t+1
        n += int(mask.sum())
    kept = stored.splits["train"]
    assert n == live_module.num_train_tokens and (kept.prompt_kept + kept.response_kept == MAX_LENGTH).any()  # some cut


def test_eagle_trains_from_the_store_as_from_the_live_target(store, generated, tiny_tokenizer, tiny_model):
    head = build_eagle(tiny_model, "eagle3", [0, 2, 1], torch.arange(200), seed=0)  # layers out of store order
    module = EagleModule(tiny_model, head, ttt_steps=3, stored_layers=FeatureStore(store, "train").layers,
                         loss=build_loss("fkl", 1.0), optimizer=torch.optim.AdamW)
    batch = next(iter(modules(generated, store, tiny_tokenizer)[0].train_dataloader()))
    live = {k: v for k, v in batch.items() if k not in ("features", "topk_ids", "topk_logprobs")}
    for a, b in zip(module._steps(batch, 3, 0.0), module._steps(live, 3, 0.0), strict=True):
        assert a.teacher.logits is None and b.teacher.logits is not None  # read, not computed
        torch.testing.assert_close(a.student, b.student, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(module._loss(a.student, a.teacher, a.labels)[0],
                                   module._loss(b.student, b.teacher, b.labels)[0], atol=1e-5, rtol=1e-5)


def test_train_stage_with_precomputed_features(tmp_path, store, tiny_target_dir, generated):
    cfg = stage_cfg(tmp_path, tiny_target_dir, generated, f"paths.features_dir={store}", "method=eagle",
                    "methods.eagle.teacher=precomputed", "loss=fkl", "methods.eagle.feature_layers=[0,1,2]",
                    "methods.eagle.vocab_size=128", "trainer.max_steps=50", "++methods.eagle.trainer.max_steps=3",
                    "++methods.eagle.trainer.val_check_interval=3")
    res = train_stage.run(cfg)
    assert res["settings"]["distill"]["teacher"] == "precomputed" and 0 < res["final"]["val/alpha"] <= 1
    assert res["steps"] == 3 and res["settings"]["trainer"]["max_steps"] == 3  # methods.eagle.trainer wins
    # methods.eagle.teacher wins over distill.teacher (live here) and the settings say which ran


@pytest.mark.parametrize(("extra", "match"), [
    (("distill.data.max_length=20",), "max_length"),
    (("methods.eagle.feature_layers=[1,2,3]",), "out of range|missing"),
    (("paths.features_dir=/nonexistent",), "features stage"),
    (("method=draft",), "EAGLE heads"),
    (("loss=jsd",), "full distribution"),
])
def test_a_store_that_does_not_fit_is_refused(tmp_path, store, tiny_target_dir, generated, extra, match):
    cfg = stage_cfg(tmp_path, tiny_target_dir, generated, f"paths.features_dir={store}", "method=eagle",
                    "distill.teacher=precomputed", "methods.eagle.teacher=precomputed", "loss=fkl",
                    "methods.eagle.feature_layers=[0,1,2]", "methods.eagle.vocab_size=128",
                    "+trainer.fast_dev_run=1", *extra)
    with pytest.raises((ConfigError, ValueError), match=match):
        train_stage.run(cfg)


def test_a_killed_stage_recomputes_only_missing_shards(tmp_path, tiny_target_dir, generated):
    cfg = stage_cfg(tmp_path, tiny_target_dir, generated)
    features_stage.run(cfg)
    shards = sorted((tmp_path / "features/train").glob("shard-*.safetensors"))
    kept, lost = shards
    before, content = kept.stat().st_mtime_ns, lost.read_bytes()
    lost.unlink()
    (lost.parent / f".{lost.name}.tmp-x").write_bytes(b"half")  # what a kill leaves behind
    res = features_stage.run(cfg)
    assert res["this_run"]["shards"] == 1 and kept.stat().st_mtime_ns == before and lost.read_bytes() == content
    assert not list(lost.parent.glob(".*.tmp-*"))
    res = features_stage.run(stage_cfg(tmp_path, tiny_target_dir, generated, "features.topk=4"))  # another store
    assert res["this_run"]["shards"] == 2 and json.loads((tmp_path / "features/manifest.json").read_text())["topk"] == 4


def test_an_empty_split_list_writes_an_empty_store(tmp_path, tiny_target_dir, generated):
    res = features_stage.run(stage_cfg(tmp_path, tiny_target_dir, generated, "features.splits=[]"))
    assert res["this_run"]["shards"] == 0 and res["splits"] == {}
    with pytest.raises(DataError, match="no feature shards"):
        FeatureStore(tmp_path / "features", "train")


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_auto_stores_the_states_in_the_targets_dtype(tmp_path, tiny_target_dir, generated, target_dtype):
    """features.dtype=auto (conf's default) follows target.dtype: EAGLE trains on the states it drafts from, not on
    bf16-rounded ones beside a float32 target (as an AVX2 machine's target.dtype=auto gives)."""
    from safetensors import safe_open

    res = features_stage.run(stage_cfg(tmp_path, tiny_target_dir, generated, "features.dtype=auto",
                                       f"target.dtype={target_dtype}"))
    assert res["dtype"] == target_dtype
    shard = sorted((tmp_path / "features/train").glob("shard-*.safetensors"))[0]
    with safe_open(shard, "pt") as f:
        assert f.get_tensor("features").dtype == getattr(torch, target_dtype)
