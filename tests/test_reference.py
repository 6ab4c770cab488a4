"""The reference trainer (stage reference): our training rows in speculators' offline format, exactly; speculators'
own trainer on a CPU through the shims, for the exact steps asked; each shim still needed (`make test-full`); and its
checkpoint read back by our evaluator. The trainer runs for real in the engine's environment (where speculators is
installed)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specdistill.core.data.datamodule import DataConfig, DistillDataModule
from specdistill.core.errors import ConfigError, DataError
from specdistill.core.io import config_hash
from specdistill.engine.environment import engine_available, engine_python
from specdistill.methods import ReferenceContext, get
from specdistill.reference import ReferenceConfig, loss_fn
from specdistill.reference.convert import VAL_ROWS, write_offline
from specdistill.reference.shims import SHIMS
from specdistill.stages import features as features_stage
from specdistill.stages.reference import LAUNCH, data_folder

from .helpers.train import composed, overrides

MAX_LENGTH = 14  # below the longest rows: the converted spans follow our truncation
LAYERS = [0, 1, 2]  # the tiny target has 2 layers: aux 0, 1, 2 and the final norm's input, 2

needs_engine = pytest.mark.skipif(not engine_available(), reason="speculators lives in the engine environment "
                                                                  "(make engine)")


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_target_dir, generated):
    tmp = tmp_path_factory.mktemp("store")
    cfg = composed(*overrides(tmp, tiny_target_dir, generated, f"paths.features_dir={tmp}/features",
                              f"features.layers={LAYERS}", "features.dtype=float32",
                              f"distill.data.max_length={MAX_LENGTH}"))
    features_stage.run(cfg)
    return tmp / "features"


@pytest.fixture(scope="module")
def rows(generated, store, tiny_tokenizer):
    module = DistillDataModule(DataConfig(batch_size=4, max_length=MAX_LENGTH), generated, "unused",
                               pad_id=tiny_tokenizer.pad_token_id, features_dir=store)
    module.setup("fit")
    return module.splits["train"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, rows, tiny_tokenizer):
    d2t = torch.arange(3, 67)  # 64 tokens
    folder = tmp_path_factory.mktemp("offline") / "data"
    made = write_offline(rows, LAYERS, [0, 1, 2], 2, d2t, len(tiny_tokenizer), folder, progress=False)
    return folder, made


def test_conversion_holds_our_training_rows_exactly(converted, rows, tiny_tokenizer):
    import datasets

    folder, made = converted
    ds = datasets.load_from_disk(str(folder))
    n = len(rows)
    assert made.rows == n and len(ds) == n + VAL_ROWS and int(len(ds) * made.train_ratio) == n
    for i in range(n + VAL_ROWS):
        ours = rows[[i % n]]  # the validation rows copy the first ones
        length = int(ours["length"][0])
        hs = load_file(str(folder / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], ours["input_ids"][0, :length])
        assert torch.equal(ds[i]["input_ids"], ours["input_ids"][0, :length]) and int(ds[i]["seq_len"]) == length
        # speculators learns token t where ours predicts it from t-1: the mask moves one later, on the response
        assert torch.equal(ds[i]["loss_mask"][1:].bool(), ours["loss_mask"][0, :length - 1])
        assert ds[i]["loss_mask"][0] == 0
        feats = ours["features"][0, :length]
        width = feats.shape[-1] // len(LAYERS)
        for j, layer in enumerate([0, 1, 2, 2]):  # the aux layers, then the final norm's input
            assert torch.equal(hs["hidden_states"][:, j], feats[:, layer * width:(layer + 1) * width])
    assert made.loss_tokens == int(rows.response_kept.sum()) and made.tokens == int(
        (rows.prompt_kept + rows.response_kept).sum())
    d2t, t2d = np.load(folder / "d2t.npy"), np.load(folder / "t2d.npy")
    assert (d2t + np.arange(64) == np.arange(3, 67)).all()  # offsets, as speculators stores them
    assert t2d.sum() == 64 and t2d[3:67].all() and len(t2d) == len(tiny_tokenizer)


def test_conversion_refuses_missing_layers_and_leaves_nothing(tmp_path, rows, tiny_tokenizer):
    with pytest.raises(DataError, match="missing \\[5\\]"):
        write_offline(rows, LAYERS, [0, 1, 5], 2, None, len(tiny_tokenizer), tmp_path / "data", progress=False)
    assert not any(tmp_path.iterdir())


def test_each_data_size_converts_to_a_folder_of_its_own(tmp_path):
    """A data curve's items (methods.<m>.data.train_fraction) must not share a conversion; batching does not
    change the rows, so it shares one."""
    def folder(**data):
        return data_folder(tmp_path, "store", [0, 1], DataConfig(**data), 64, {2})

    assert folder(train_fraction=0.25) != folder(train_fraction=0.5) != folder()
    assert folder(batch_size=2, num_workers=1) == folder() == folder(train_fraction=1)
    # the whole data keeps the name an older version gave it: a finished reference run is not redone
    assert folder().name == "data-" + config_hash({"store": "store", "aux": [0, 1], "vocab": 64, "stops": [2]})[:12]


def test_reference_config_and_method_flags_are_checked(tiny_tokenizer):
    with pytest.raises(ConfigError, match="recipe"):
        ReferenceConfig(dir="d", work_dir="w", verifier="v",
                        items={"x": {"method": "eagle", "name": "eagle", "recipe": "mine"}})
    with pytest.raises(ConfigError, match="stage sets it"):
        ReferenceConfig(dir="d", work_dir="w", verifier="v", items={}, extra_args=["--max-steps", "3"])
    with pytest.raises(ConfigError, match="no such loss"):
        loss_fn("topk_kl", "methods.eagle")
    from specdistill.methods.dflash import DFlashMethodConfig
    from specdistill.methods.eagle import EagleMethodConfig

    ctx = ReferenceContext("matched", 30, 8, tiny_tokenizer, {2}, "kl_div")
    args = get("eagle", "reference").reference(EagleMethodConfig(), ctx)
    assert args.aux == [2, 15, 27] and "--no-norm-before-residual" in args.args and "kl_div" in args.args
    shipped = get("eagle", "reference").reference(EagleMethodConfig(), ReferenceContext("shipped", 30, 8,
                                                                                        tiny_tokenizer, {2}, ""))
    assert "--no-norm-before-residual" not in shipped.args and "--loss-fn" not in shipped.args
    with pytest.raises(ConfigError, match="variant"):
        get("eagle", "reference").reference(EagleMethodConfig(variant="eagle1"), ctx)
    block = get("dflash", "reference").reference(DFlashMethodConfig(), ctx)
    assert block.args[block.args.index("--max-anchors") + 1] == str(32 * 8)  # ours per sequence x sequences
    with pytest.raises(ConfigError, match="markov_rank"):
        get("dflash", "reference").reference(DFlashMethodConfig(markov_rank=4), ctx)


def launch(tmp_path, data, verifier, steps: int, *extra: str, dtype: str = "float32") -> subprocess.CompletedProcess:
    meta = json.loads((data / "meta.json").read_text())
    cmd = [str(engine_python()), str(LAUNCH), "--steps", str(steps), "--train-ratio", repr(meta["train_ratio"]),
           "--record", str(tmp_path / "run.json"), *extra, "--",
           "--verifier-name-or-path", str(verifier), "--data-path", str(data), "--save-path", str(tmp_path / "run"),
           "--speculator-type", "eagle3", "--target-layer-ids", "0", "1", "2", "--draft-vocab-size", "64",
           "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"), "--total-seq-len", "24",
           "--hidden-states-dtype", dtype, "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
           "--num-workers", "0", "--optimizer", "adamw", "--logger", "", "--log-dir", str(tmp_path / "logs"),
           "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual", "--full-attention-indices", "0",
           "--mask-token-id", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"})


@needs_engine
def test_speculators_trains_the_exact_steps_on_a_cpu_resumes_and_we_read_its_checkpoint(tmp_path, converted,
                                                                                         tiny_target_dir, tiny_model):
    from specdistill.methods.eagle.model import load_eagle

    data, made = converted
    steps = 30  # more than one epoch of packed batches: the epochs come from speculators' own sampler
    done = launch(tmp_path, data, tiny_target_dir, steps)
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["steps"] == steps and record["epochs"] >= 2 and 0 < record["tokens"] <= steps * 24
    state = json.loads((tmp_path / "run" / str(record["epochs"] - 1) / "training_state.json").read_text())
    assert state["global_step"] == steps, state  # ended at the step asked, not one more per later epoch
    head = load_eagle(record["checkpoint"], tiny_model)  # our evaluator reads speculators' own checkpoint
    assert head.cfg.variant == "eagle3" and head.d2t.tolist() == list(range(3, 67))
    weights = load_file(str(tmp_path / "run" / str(record["epochs"] - 1) / "model.safetensors"))
    assert torch.equal(head.midlayer.self_attn.q_proj.weight.float(),
                       weights["layers.0.self_attn.q_proj.weight"].float())

    # killed during the last epoch: a rerun resumes from the epoch before (which needs the `resume` shim)
    (tmp_path / "run" / str(record["epochs"] - 1)).rename(tmp_path / "killed")
    needed(launch(tmp_path, data, tiny_target_dir, steps, "--without", "resume"), "resume")
    again = launch(tmp_path, data, tiny_target_dir, steps)
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["resumed"] and record["tokens_per_s"] is None  # no rate from a run this process only finished
    state = json.loads((tmp_path / "run" / str(record["epochs"] - 1) / "training_state.json").read_text())
    assert state["global_step"] == steps


@needs_engine
@pytest.mark.full  # its answer changes only with the pinned speculators (requirements-engine.txt): `make test-full`
@pytest.mark.parametrize("shim", sorted(set(SHIMS) - {"resume"}))  # resume: in the test above, where a run resumes
def test_each_cpu_shim_is_still_needed(tmp_path, converted, tiny_target_dir, shim):
    """A newer speculators that trains on a CPU without one of them fails here: then remove that shim."""
    data, _ = converted
    done = launch(tmp_path, data, tiny_target_dir, 2, "--without", shim, dtype="bfloat16")  # autocast: in bf16
    needed(done, shim)


def needed(done: subprocess.CompletedProcess, shim: str) -> None:
    assert done.returncode != 0, f"speculators trained on a CPU without the `{shim}` shim: remove it from shims.py"
    assert SHIMS[shim][1] in done.stderr, done.stderr[-3000:]


def test_a_serve_item_names_its_method_so_the_engine_serves_a_reference_checkpoint():
    from specdistill.core.config import section
    from specdistill.engine.serving import ServeConfig

    from .helpers.config import composed as full

    serve = dict(full("serve.method=ref_eagle_matched")["serve"])
    cfg = section(ServeConfig, serve, "serve")
    assert cfg.registered == "eagle" and cfg.models == {"eagle": "models/reference/eagle_matched"}
    assert cfg.items["ref_eagle_shipped"]["agreement"] is False  # our head does not read speculators' own norms
    with pytest.raises(ConfigError, match="keys method"):
        section(ServeConfig, {**serve, "items": {**serve["items"], "x": {"engine": "a", "ours": "b"}}}, "serve")
