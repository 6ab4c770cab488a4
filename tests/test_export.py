"""Engine-ready exports without the engine: the target folder round-trips through `transformers`, the EAGLE-3
speculators folder holds what vLLM reads, and a bad export is refused before any engine sees it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdistill.core.errors import ConfigError
from specdistill.export.target import ExportError, engine_context, export_target, exported_fingerprint
from specdistill.methods.eagle.export import eagle3_state, export_eagle3
from specdistill.methods.eagle.model import build_eagle

from .helpers.models import make_model


@pytest.fixture
def exported(tmp_path, tiny_tokenizer):
    model = make_model(len(tiny_tokenizer), layers=4)
    return model, export_target(model, tiny_tokenizer, tmp_path / "target", fingerprint="fp-a")


def test_the_target_folder_loads_in_transformers_with_the_same_logits(exported, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, folder = exported
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert AutoTokenizer.from_pretrained(folder).chat_template == tiny_tokenizer.chat_template
    assert exported_fingerprint(folder) == "fp-a"
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in folder.iterdir() if p.is_file())  # others can serve it


def test_eagle3_export_has_the_engine_fields_and_order(exported, tmp_path):
    model, folder = exported
    d2t = torch.tensor([7, 3, 100, 5, 64, 2])  # unsorted, as a frequency order gives it
    head = build_eagle(model, "eagle3", [3, 1, 2], d2t=d2t, fingerprint="fp-a")
    out = export_eagle3(head, tmp_path / "eagle", folder, num_speculative_tokens=4)
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["model_type"] == "llama" and cfg["draft_vocab_size"] == 6
    state = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith(("midlayer.", "rotary.")) for k in state) and "layers.0.hidden_norm.weight" in state
    target_ids = state["d2t"] + torch.arange(6)
    assert target_ids.tolist() == sorted(d2t.tolist()) and int(state["t2d"].sum()) == 6
    # the same distribution: row i of the exported head scores target id target_ids[i], as our row for that id did
    ours = dict(zip(d2t.tolist(), head.lm_head.weight.detach(), strict=True))
    assert all(torch.equal(state["lm_head.weight"][i], ours[t]) for i, t in enumerate(target_ids.tolist()))
    # fc's blocks follow the ascending layer ids the engine concatenates: ours read [3, 1, 2]
    h = model.config.hidden_size
    fc = head.fc.weight.detach()
    assert torch.equal(state["fc.weight"][:, :h], fc[:, h:2 * h]) and \
        torch.equal(state["fc.weight"][:, 2 * h:], fc[:, :h])


def test_eagle31_exports_its_flags_and_fc_norms_in_the_engines_order(exported, tmp_path):
    model, folder = exported
    head = build_eagle(model, "eagle3", [3, 1, 2], fingerprint="fp-a", fc_norm=True, norm_output=True)
    with torch.no_grad():
        for i, norm in enumerate(head.fc_norm):
            norm.weight.fill_(float(i + 1))  # ours: layer 3 -> 1, layer 1 -> 2, layer 2 -> 3
    out = export_eagle3(head, tmp_path / "eagle31", folder)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["norm_before_fc"] is False
    state = load_file(str(out / "model.safetensors"))
    # the engine's chunk j is layer [1, 2, 3][j]
    assert [float(state[f"fc_norm.{j}.weight"][0]) for j in range(3)] == [2.0, 3.0, 1.0]


def test_full_vocabulary_head_writes_no_d2t(exported, tmp_path):
    model, folder = exported
    state, _ = eagle3_state(build_eagle(model, "eagle3", [1, 2, 3]))
    assert "d2t" not in state and "t2d" not in state  # vLLM has no slot for them and would refuse the load


def test_a_bad_export_is_refused_before_the_engine(exported, tmp_path, tiny_tokenizer):
    model, folder = exported
    head = build_eagle(model, "eagle3", [1, 2, 3], fingerprint="fp-a")
    other = make_model(len(tiny_tokenizer) + 8, layers=4)  # another vocabulary
    other_dir = export_target(other, tiny_tokenizer, tmp_path / "other", fingerprint="fp-b")
    with pytest.raises(ExportError, match="vocab_size"):
        export_eagle3(head, tmp_path / "e1", other_dir)
    same_shape = export_target(make_model(len(tiny_tokenizer), seed=1, layers=4), tiny_tokenizer, tmp_path / "t2",
                               fingerprint="fp-c")
    with pytest.raises(ExportError, match="trained on target"):
        export_eagle3(head, tmp_path / "e2", same_shape)
    with pytest.raises(ExportError, match="no exported target"):
        export_eagle3(head, tmp_path / "e3", tmp_path / "nowhere")
    broken = build_eagle(model, "eagle3", [1, 2, 3], fingerprint="fp-a")
    del broken.norm  # a head missing a tensor the engine needs
    broken.norm = None
    with pytest.raises(ExportError, match="lacks"):
        export_eagle3(broken, tmp_path / "e4", folder)
    with pytest.raises(ExportError, match="eagle3"):
        export_eagle3(build_eagle(model, "eagle1", [4]), tmp_path / "e5", folder)
    assert not any((tmp_path / f"e{i}").exists() for i in range(1, 6))


def test_the_separate_draft_exports_only_with_the_full_vocabulary(exported, tmp_path):
    from transformers import AutoModelForCausalLM

    from specdistill.methods.draft.export import export_draft
    from specdistill.methods.draft.model import DraftSize, build_draft, save_draft

    model, folder = exported
    size = DraftSize(name="t", num_layers=1)
    save_draft(build_draft(model, size), tmp_path / "full")
    out = export_draft(tmp_path / "full", tmp_path / "export_draft", folder)
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 6, 7]])  # HF assisted generation takes it as it is, in the target's token ids
    got = model.generate(ids, assistant_model=draft, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert torch.equal(got, model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2))
    assert (out / "tokenizer.json").exists()
    save_draft(build_draft(model, size, d2t=torch.arange(0, 64)), tmp_path / "reduced")
    with pytest.raises(ExportError, match="train@draft_full"):
        export_draft(tmp_path / "reduced", tmp_path / "export_reduced", folder)
    assert not (tmp_path / "export_reduced").exists()


def test_medusa_exports_in_vllms_layout(exported, tmp_path, tiny_tokenizer):
    """vLLM's Medusa names and config, the reduced head as its token map, the blocks as ours compute them; a
    target it was not trained on is refused."""
    from specdistill.methods.medusa.export import export_medusa
    from specdistill.methods.medusa.model import build_medusa

    model, folder = exported
    d2t = torch.tensor([40, 3, 17, 9, 2, 60])
    heads = build_medusa(model, num_heads=3, num_layers=2, d2t=d2t, fingerprint="fp-a")
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = export_medusa(heads, tmp_path / "medusa", folder)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 2
    assert cfg["truncated_vocab_size"] == 6 and cfg["vocab_size"] == model.config.vocab_size and cfg["medusa_fc_bias"]
    state = load_file(out / "model.safetensors")
    assert sorted(state) == sorted([f"blocks.{h}.layers.{i}.{p}" for h in range(3) for i in range(2)
                                    for p in ("weight", "bias")]
                                   + [f"lm_heads.{h}.weight" for h in range(3)] + ["token_map"])
    assert state["token_map"].tolist() == d2t.tolist()
    x = torch.randn(4, model.config.hidden_size)  # vLLM's block: x + SiLU(W x + b), then the projection
    h = x
    for i in range(2):
        h = h + torch.nn.functional.silu(h @ state[f"blocks.1.layers.{i}.weight"].T
                                         + state[f"blocks.1.layers.{i}.bias"])
    torch.testing.assert_close(h @ state["lm_heads.1.weight"].T, heads.head(2, x).detach())
    with pytest.raises(ExportError, match="num_heads=4"):
        export_medusa(heads, tmp_path / "m2", folder, num_heads=4)
    other = export_target(make_model(len(tiny_tokenizer), seed=1, layers=4), tiny_tokenizer, tmp_path / "t2",
                          fingerprint="fp-c")
    with pytest.raises(ExportError, match="trained on target"):
        export_medusa(heads, tmp_path / "m3", other)
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


def test_the_deployed_schedule_serves_each_load_its_chosen_k():
    """K per concurrency becomes vLLM's batch-size schedule; 0 where speculation lost and above the loads measured;
    None when it lost everywhere."""
    from specdistill.engine.serving import deploy_schedule

    class Cfg:
        method, registered, concurrency, ngram_max, ngram_min = "eagle", "eagle", [16, 1, 4], 3, 1

    chosen = {"c1": {"deploy_k": 3}, "c4": {"deploy_k": 1}, "c16": {"deploy_k": 0}}
    spec = deploy_schedule(Cfg(), chosen, "models/export/eagle")
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 1], [5, 16, 0]]
    assert deploy_schedule(Cfg(), {c: {"deploy_k": 0} for c in chosen}, "x") is None
    # speculation that pays at the largest load measured stops above it: vLLM would carry K=2 to every larger batch
    won = deploy_schedule(Cfg(), {"c1": {"deploy_k": 3}, "c4": {"deploy_k": 1}, "c16": {"deploy_k": 2}}, "x")
    assert won["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 1], [5, 16, 2], [17, 17, 0]]


def test_serve_leaves_out_the_k_a_medusa_export_cannot_draft(tmp_path):
    """vLLM drafts one token per Medusa head: serve.k beyond the export's heads is left out and named; an agreement
    K among them, or no K left, is an error before any engine starts."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specdistill import methods
    from specdistill.core.config import section
    from specdistill.core.errors import ConfigError
    from specdistill.engine.serving import ServeConfig
    from specdistill.stages.serve import servable_k

    from .helpers.project import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_container(compose("config", overrides=["serve.method=medusa", "serve.k=[1,3,5]"]),
                                     resolve=True)["serve"]
    serve_cfg = section(ServeConfig, dict(cfg), "serve")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 4}))
    served, skipped = servable_k(serve_cfg, methods.get("medusa", "serve"), tmp_path)
    assert served.k == [1, 3] and skipped == [5]
    with pytest.raises(ConfigError, match="drafts at most 4 tokens"):
        servable_k(section(ServeConfig, {**cfg, "k": [5, 6], "agreement_k": 5}, "serve"),
                   methods.get("medusa", "serve"), tmp_path)
    assert servable_k(serve_cfg, methods.get("eagle", "serve"), tmp_path) == (serve_cfg, [])


def test_a_speedup_above_tau_is_flagged_as_a_slow_baseline():
    """Each engine step costs at least a target forward and yields tau tokens: a speed-up well above tau can only
    come from an engine-alone start that ran slow; summarise names those runs, the report says to check them."""
    from specdistill.engine.serving import summarise
    from specdistill.reporting.serving import serving_tables

    class Cfg:
        concurrency, k, deploy_min_speedup = [1], [1, 3], 1.0

    def run(tokens_per_s, accepted=0, drafts=0):
        spec = {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": drafts,
                "vllm:spec_decode_num_accepted_tokens": accepted,
                "vllm:spec_decode_num_accepted_tokens_per_pos": [accepted]}
        return {"runs": [{"name": "mtbench|0.0|1", "wall_s": 1.0, "output_tokens": tokens_per_s,
                          "requests": [{"latency_s": 1.0, "token_ids": []}], "spec": spec}]}

    # tau 1.2 for both K; K=1 at 1.15x is possible, K=3 at 1.5x is not
    out = summarise(Cfg(), {"ar": run(100), "k1": run(115, 20, 100), "k3": run(150, 20, 100)})
    assert out["above_tau"] == ["mtbench|T0.0|c1|k3"]
    m = {"settings": {"k": [1, 3]}, **out, "deploy": None, "cold_start_s": {}, "agreement": {}}
    text = "\n".join(serving_tables({"eagle": m, "medusa": {**m, "settings": {"k": [1]}, "above_tau": []}}))
    assert "**Check these:** 1 run(s)" in text and "eagle mtbench|T0.0|c1|k3" in text
    assert "| medusa | 1 | " in text and text.count("–") >= 1  # K=3 not served by medusa: a dash, not a shifted column


def test_the_engine_alone_before_and_after_the_k_starts_is_the_baseline():
    """serve.ar_bracket: a machine that slowed during the stage (the engine alone at 100 tokens/s first, 80 last)
    gives the K starts the mean of the two as their baseline, keeps both, and names the run as drifted."""
    from specdistill.engine.serving import summarise

    class Cfg:
        concurrency, k, deploy_min_speedup = [1], [1], 1.0

    def run(tokens_per_s, accepted=0, drafts=0):
        spec = {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": drafts,
                "vllm:spec_decode_num_accepted_tokens": accepted,
                "vllm:spec_decode_num_accepted_tokens_per_pos": [accepted]}
        return {"runs": [{"name": "mtbench|0.0|1", "wall_s": 1.0, "output_tokens": tokens_per_s,
                          "requests": [{"latency_s": 1.0, "token_ids": []}], "spec": spec}]}

    out = summarise(Cfg(), {"ar": run(100), "k1": run(99, 50, 100), "ar_last": run(80)})
    cell = out["results"]["mtbench"]["T0.0"]["c1"]
    assert set(cell) == {"ar", "k1"} and cell["ar"]["tokens_per_s"] == 90.0
    assert cell["ar"]["tokens_per_s_first"] == 100 and cell["ar"]["tokens_per_s_last"] == 80
    assert cell["k1"]["speedup"] == 1.1 and out["baseline_drift"] == ["mtbench|T0.0|c1"]
    steady = summarise(Cfg(), {"ar": run(100), "k1": run(99, 50, 100), "ar_last": run(96)})
    assert steady["baseline_drift"] == [] and steady["results"]["mtbench"]["T0.0"]["c1"]["ar"]["drift"] == 0.0408


def test_the_engine_runs_its_core_in_the_workers_process_unless_asked(tmp_path, monkeypatch):
    """serve.multiprocessing: false (the default) runs vLLM's engine core in the worker's process; true restores
    vLLM's own layout; a VLLM_ENABLE_V1_MULTIPROCESSING the user set is kept either way."""
    from specdistill.engine.client import engine_env

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    py = tmp_path / "bin/python"
    assert engine_env(py)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert engine_env(py, multiprocessing=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert engine_env(py)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@pytest.mark.parametrize("eagle31", [False, True])
def test_a_speculators_eagle3_folder_drafts_as_the_head_it_came_from(exported, tmp_path, eagle31):
    """decode.eagle.path may name a speculators-format EAGLE-3 folder (ours, or any speculators trainer's): read back,
    it drafts exactly as the head it was written from (unsorted layers and draft vocabulary, EAGLE-3.1's flags), so
    our decoder measures a reference trainer's checkpoint as it measures ours."""
    from specdistill.decoding.loop import speculative_generate
    from specdistill.decoding.protocols import SamplingConfig
    from specdistill.decoding.verifier import TargetVerifier
    from specdistill.methods.eagle.model import load_eagle
    from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig

    model, folder = exported
    head = build_eagle(model, "eagle3", [3, 1, 2], d2t=torch.tensor([7, 3, 100, 5, 64, 2, 9, 40]), fingerprint="fp-a",
                       fc_norm=eagle31, norm_output=eagle31)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    head = head.eval()
    back = load_eagle(export_eagle3(head, tmp_path / "eagle", folder), model, target_fingerprint="fp-a")
    assert back.cfg.feature_layers == [1, 2, 3] and back.cfg.fc_norm is eagle31 and back.cfg.norm_output is eagle31

    def run(h, tree, sampling):
        proposer = EagleProposer(h, tree, capacity=64)
        verifier = TargetVerifier(model, 64, feature_layers=proposer.feature_layers)
        return speculative_generate(verifier, proposer, [1, 5, 6, 7], 12, set(), sampling,
                                    torch.Generator().manual_seed(1))

    static = EagleTreeConfig(shape="static", branching=[3, 2])
    assert [r.accepted for r in run(head, static, SamplingConfig()).rounds] == \
        [r.accepted for r in run(back, static, SamplingConfig()).rounds]
    chain = EagleTreeConfig(shape="chain", k=3)
    ours, theirs = (run(h, chain, SamplingConfig(1.0)).rounds for h in (head, back))
    assert [r.alpha_exact for r in ours] == pytest.approx([r.alpha_exact for r in theirs], abs=1e-5)


def test_a_speculators_folder_for_another_verifier_or_head_is_refused(exported, tmp_path, tiny_tokenizer):
    from specdistill.methods.eagle.model import EagleError, load_eagle

    model, folder = exported
    out = export_eagle3(build_eagle(model, "eagle3", [3, 1, 2], fingerprint="fp-a"), tmp_path / "eagle", folder)
    with pytest.raises(EagleError, match="fingerprint"):  # names an exported target this one is not
        load_eagle(out, model, target_fingerprint="fp-b")
    other = make_model(len(tiny_tokenizer) + 8, layers=4)  # another tokenizer
    with pytest.raises(EagleError, match="vocabulary .* and width"):
        load_eagle(out, other)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    with pytest.raises(EagleError, match="norm_before_residual.*another drafter"):  # speculators' other recipe
        load_eagle(out, model)


def test_the_engine_context_is_the_targets_unless_set_and_never_beyond_it(tmp_path):
    """serve@ and online_engine@ check their max_model_len before the engine starts (vLLM fails later, in its log)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    assert engine_context(tmp_path, None, "serve.max_model_len") == 256
    assert engine_context(tmp_path, 128, "online.engine.max_model_len") == 128
    with pytest.raises(ConfigError, match=r"online.engine.max_model_len=512 exceeds the target's context \(256"):
        engine_context(tmp_path, 512, "online.engine.max_model_len")
