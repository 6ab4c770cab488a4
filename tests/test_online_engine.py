"""Online distillation inside the real engine (vLLM, `.venv-engine`) on tiny random models.

The trainer's side (online/engine.py) and the engine's (engine/online_worker.py) over the real channel: what the
engine reports judges exactly the positions our decoder judges, with the target's own distribution there; a new
drafter version reaches the running engine and is the one that drafts; T=0 answers stay the target's greedy ones
across versions and T=1 answers keep the target's law while the drafter changes under requests in flight; and the
online_engine stage serves, learns and measures in one engine start.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.core.records import read_record
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.verifier import TargetVerifier
from specdistill.engine.client import EngineProcess
from specdistill.export.target import export_target
from specdistill.methods.draft.model import draft_from_target, load_draft, save_draft
from specdistill.methods.draft.proposer import DraftLMProposer
from specdistill.online.engine import Channel, request_record
from specdistill.online.recorder import RecordingVerifier
from specdistill.online.server import OnlineDistiller

from .helpers.data import save_code_prompts
from .helpers.models import make_engine_model, make_tokenizer

pytestmark = pytest.mark.engine
K, NEW, TOPK = 3, 20, 16


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def trainable(draft) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in draft.named_parameters() if "embed_tokens" not in k}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An exported tiny target, a 2-layer draft cut from it (A, what the engine starts with) and the same draft
    with other weights (B): both over the target's whole vocabulary, as vLLM's draft_model needs."""
    tmp = tmp_path_factory.mktemp("online_engine")
    tok = make_tokenizer()
    model = make_engine_model(len(tok))
    target_dir = export_target(model, tok, tmp / "export/target", fingerprint="tiny-online-engine")
    a = draft_from_target(model, 2).float()
    save_draft(a, tmp / "models/draft_full", tokenizer=tok)
    b = draft_from_target(model, 2).float()
    with torch.no_grad():  # B: its second layer a different one of the target's, its first the same
        b.model.layers[1].load_state_dict(model.model.layers[3].state_dict())
    return {"tmp": tmp, "tok": tok, "model": model, "target": target_dir, "a": a, "b": b}


def ours(model, draft, prompt: list[int]):
    """Our decoder's record of one request (K-token chains at T=0), and its answer."""
    ver = RecordingVerifier(TargetVerifier(model, capacity=256), topk=TOPK)
    res = speculative_generate(ver, DraftLMProposer(draft, k=K), prompt, NEW + K + 1, stops=set())
    return ver.record.finish(res.tokens), res.tokens[:NEW]


def judged(rec, below: int) -> list[tuple[int, bool]]:
    """The judgements before position `below` (the engine drafts K tokens in a request's last step where our loop
    shortens its chain: their tails differ by design, so ours runs further and the heads are compared)."""
    return [(p, ok) for p, ok in zip(rec.positions, rec.accepted, strict=True) if p < below]


def test_the_engine_reports_our_judgements_loads_new_drafters_and_keeps_the_law(tiny, tmp_path):
    """One engine start, three phases over the real channel. A: the starting drafter, logprobs on; B: after the
    test deployed drafter B (and said it is done); T=1: 800 requests of 2 tokens at concurrency 16 while the test
    swaps A and B in every 100 answers."""
    from .helpers.stats import chi2_p

    model, tok = tiny["model"], tiny["tok"]
    plist = prompts(6, 3, len(tok))
    t1_prompt, t1_n = [1, 40, 41, 42, 43], 800
    channel = Channel(tmp_path / "channel")
    job = {"target": str(tiny["target"]), "dtype": "float32", "max_model_len": 512, "seed": 0,
           "speculative_config": {"method": "draft_model", "model": str(tiny["tmp"] / "models/draft_full"),
                                  "num_speculative_tokens": K},
           "online": {"channel": str(channel.folder), "temperature": 0.0, "max_tokens": NEW, "wait_s": 600,
                      "phases": [{"name": "a", "prompts": plist, "logprobs": TOPK, "ignore_eos": True, "learn": True},
                                 {"name": "b", "prompts": plist, "after_final": True, "ignore_eos": True},
                                 {"name": "t1", "prompts": [t1_prompt] * t1_n, "temperature": 1.0, "max_tokens": 2,
                                  "concurrency": 16, "ignore_eos": True}]}}
    engine = EngineProcess(job, relay=False, log_path=tmp_path / "engine.log")
    rows: dict[str, list] = {"a": [], "b": [], "t1": []}
    try:
        for row in channel.requests(engine, 900):
            rows[row["phase"]].append(row)
            if row["phase"] == "a" and len(rows["a"]) == len(plist):
                channel.deploy(trainable(tiny["b"]), final=True)
            if row["phase"] == "t1" and len(rows["t1"]) % 100 == 0 and len(rows["t1"]) < t1_n:
                channel.deploy(trainable(tiny["a" if channel.version % 2 else "b"]))
        result = engine.finish()
    except BaseException:
        engine.kill()
        raise
    assert [len(rows[p]) for p in rows] == [len(plist), len(plist), t1_n]  # no request lost

    for phase, draft in (("a", tiny["a"]), ("b", tiny["b"])):
        for row in sorted(rows[phase], key=lambda r: r["index"]):
            prompt = plist[row["index"]]
            mine, answer = ours(model, draft, prompt)
            assert row["token_ids"] == answer, phase  # T=0: the target's greedy answer with either drafter
            theirs = request_record(prompt, row, K)
            below = len(prompt) + NEW - K - 2
            # the drafter that served is the one deployed: the engine judged what our decoder judges with it
            assert judged(theirs, below) == judged(mine, below), (phase, row["index"])
            assert set(row["versions"][1:]) == {0 if phase == "a" else 1}
            if phase == "a":  # the teacher: the target's own top-k at each judged position
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([theirs.tokens])).logits[0].float(), -1)
                for p, ids, lp in zip(theirs.positions, theirs.topk_ids, theirs.topk_logprobs, strict=True):
                    torch.testing.assert_close(lp, logp[p, ids], atol=1e-4, rtol=1e-4)
                    assert int(ids[0]) == theirs.tokens[p + 1]  # T=0: what followed is the target's argmax
    acc = {p: sum(request_record(plist[r["index"]], r, K).num_accepted for r in rows[p]) for p in ("a", "b")}
    assert acc["a"] != acc["b"], "the two drafters must draft differently, or the swap proves nothing"

    versions = [set(r["versions"]) for r in rows["t1"]]
    assert len(set().union(*versions)) >= 4 and any(len(v) > 1 for v in versions), \
        "the drafter must change under requests in flight"
    loaded = [s["version"] for s in result["swaps"]]  # each newer than the last; the engine may skip one it outran
    assert loaded == sorted(set(loaded)) and result["final_version"] == loaded[-1] <= channel.version
    second = torch.tensor([r["token_ids"][1] for r in rows["t1"]])
    with torch.no_grad():
        first = model(torch.tensor([t1_prompt])).logits[0, -1].double().softmax(-1)
        vocab = first.shape[0]
        both = torch.cat([torch.tensor([t1_prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        then = model(both).logits[:, -1].double().softmax(-1)
    assert chi2_p(second, first @ then, min_expected=5) > 1e-3
    assert len(list(channel.folder.glob("v*.safetensors"))) <= 2  # the engine's old versions are not kept


def test_the_online_engine_stage_learns_while_the_engine_serves(tiny, monkeypatch):
    from specdistill.stages import online_engine

    tmp = tiny["tmp"]
    save_code_prompts(tiny["tok"], tmp / "prompts/humaneval", n=9)
    monkeypatch.chdir(tmp)
    cfg = {"paths": {"prompts_dir": "prompts", "models_dir": "models", "metrics_dir": "metrics", "plots_dir": "plots"},
           "export": {"dir": "export"}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny["target"]), "dtype": "float32"},
           "online": {"requests": 6, "held_out": 3, "max_new_tokens": 16, "update_every": 2, "steps": 2,
                      "batch_size": 2, "topk": TOPK, "lr": 3e-3,
                      "engine": {"k": {"draft": K}, "max_model_len": 512, "dtype": "float32",
                                 "items": {"draft": "models/draft_full"}}}}
    metrics = online_engine.run(cfg)
    saved = read_record(tmp / "metrics/online_engine_draft.json")
    assert saved["held_out"]["frozen"]["requests"] == 3 and saved["stream"]["online"]["requests"] == 6
    deployed = [u for u in saved["updates"] if u["deployed"]]
    eng = metrics["engine"]
    assert deployed and eng["versions_loaded"] == eng["final_version"] == len(deployed)
    # T=0: the learning drafter changed no answer (float32: the same as the frozen run's, request by request)
    assert eng["identical_to_frozen"] == {"requests": 9, "identical": 9}
    curve = (tmp / "plots/online_engine_draft/curve.csv").read_text().splitlines()
    assert len(curve) == 10 and curve[0].endswith(",version")
    held = [int(line.rsplit(",", 1)[1]) for line in curve[7:]]
    assert held == [len(deployed)] * 3  # the held-out requests: the draft as the stream left it
    # the saved final version (what the engine served last) is not the draft the stream started with
    final = load_draft(tmp / "models/online_engine_draft/final")
    assert not torch.equal(final.model.layers[0].mlp.down_proj.weight, tiny["a"].model.layers[0].mlp.down_proj.weight)
    assert json.loads((tmp / "models/online_engine_draft/final/specdistill.json").read_text())["requests"] == 6
    cfg["online"]["loss"] = "jsd"
    with pytest.raises(ValueError, match="top-k at the judged"):
        online_engine.run(cfg)
    cfg["online"].update(loss="fkl", engine={"k": {"draft": 0}})
    with pytest.raises(ValueError, match="online.engine.k.draft=0"):
        online_engine.run(cfg)
    cfg["online"].update(engine={"k": {"draft": K}, "max_model_len": 1 << 20})
    with pytest.raises(ValueError, match="exceeds the target's context"):
        online_engine.run(cfg)
    cfg["online"].update(engine={"k": {"draft": K}, "bogus": 1})
    with pytest.raises(ValueError, match="bogus"):
        online_engine.run(cfg)


def test_an_eagle3_head_learning_in_the_engine_is_the_one_that_drafts(tiny, tmp_path):
    """EAGLE-3 (vLLM's eagle3 drafter): the method's own engine export of a random head starts the engine, and the
    weights its `engine_weights` hands over after the head learnt (speculators' names, the export's fc order, no
    vocabulary maps) are the ones that draft once loaded: the engine judges what our decoder judges with each
    version, request by request."""
    from specdistill import methods
    from specdistill.core.models.target import TargetConfig, load_target
    from specdistill.methods.eagle.model import save_eagle
    from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
    from specdistill.online.policy import OnlineConfig

    from .helpers.drafts import random_head

    loaded = load_target(TargetConfig(name_or_path=str(tiny["target"]), dtype="float32"))
    head = random_head(loaded.model, "eagle3", torch.arange(200), scale=0.05)
    head.cfg.target_fingerprint = loaded.fingerprint
    save_eagle(head, tmp_path / "models/eagle")
    cfg = OnlineConfig(method="eagle", items={"eagle": str(tmp_path / "models/eagle")}, lr=3e-3, steps=4,
                       batch_size=4, update_every=10**6, topk=TOPK, replay_accepted=1.0)
    student = methods.get("eagle", "online", "online.method").online(cfg, loaded, cfg.items["eagle"], None)
    chain = EagleTreeConfig(shape="chain", k=K)
    # a random head accepts nothing: learn a little first, in our decoder (the online stage's own server)
    server = OnlineDistiller(student.module, EagleProposer(student.serving, chain, capacity=256),
                             TargetVerifier(loaded.model, capacity=256, feature_layers=head.cfg.feature_layers), cfg,
                             set(), 2, deploy=lambda: student.serving.load_state_dict(student.student.state_dict()))

    def learn(updates: int) -> None:
        for _ in range(updates):
            server.update()

    student.engine_export(tmp_path / "start", tiny["target"])  # the random head: it accepts nothing
    for p in prompts(8, 9, len(tiny["tok"])):
        server.serve(p)
    plist = prompts(4, 5, len(tiny["tok"]))
    channel = Channel(tmp_path / "channel")
    job = {"target": str(tiny["target"]), "dtype": "float32", "max_model_len": 512, "seed": 0,
           "speculative_config": {"method": "eagle3", "model": str(tmp_path / "start"), "num_speculative_tokens": K},
           "online": {"channel": str(channel.folder), "temperature": 0.0, "max_tokens": NEW, "wait_s": 600,
                      "phases": [{"name": "a", "prompts": plist, "ignore_eos": True},
                                 {"name": "b", "prompts": plist, "after_final": True, "ignore_eos": True}]}}
    before = {k: v.clone() for k, v in student.student.state_dict().items()}
    engine = EngineProcess(job, relay=False, log_path=tmp_path / "engine.log")
    rows: dict[str, list] = {"a": [], "b": []}
    try:
        for row in channel.requests(engine, 900):
            rows[row["phase"]].append(row)
            if row["phase"] == "a" and len(rows["a"]) == len(plist):
                learn(20)  # the next version, learnt while the engine waits
                channel.deploy(student.engine_weights(), final=True)
        engine.finish()
    except BaseException:
        engine.kill()
        raise
    after = {k: v.clone() for k, v in student.student.state_dict().items()}
    accepted = {}
    for phase, state in (("a", before), ("b", after)):
        student.student.load_state_dict(state)
        proposer = EagleProposer(student.student.eval(), chain, capacity=256)
        accepted[phase] = 0
        for row in rows[phase]:
            prompt = plist[row["index"]]
            ver = RecordingVerifier(TargetVerifier(loaded.model, capacity=256, feature_layers=proposer.feature_layers),
                                    topk=TOPK)
            res = speculative_generate(ver, proposer, prompt, NEW + K + 1, stops=set())
            mine, theirs = ver.record.finish(res.tokens), request_record(prompt, row, K)
            assert row["token_ids"] == res.tokens[:NEW], phase
            below = len(prompt) + NEW - K - 2
            assert judged(theirs, below) == judged(mine, below), (phase, row["index"])
            accepted[phase] += theirs.num_accepted
    assert accepted["a"] == 0 < accepted["b"], "the learnt version must accept what the random head did not"
