"""Online speculative distillation on tiny random models: recording, updates, stopping, losslessness, the stage."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdistill.core.records import read_record
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.draft.model import save_draft
from specdistill.methods.draft.proposer import DraftLMProposer
from specdistill.methods.draft.training import DraftLMModule
from specdistill.online.buffer import RejectionBuffer
from specdistill.online.engine import request_record, version_rate
from specdistill.online.policy import OnlineConfig, StoppingRule
from specdistill.online.recorder import RecordingVerifier
from specdistill.online.server import OnlineDistiller
from specdistill.training.losses import Teacher, build_loss

from .helpers.data import save_code_prompts
from .helpers.decoding import PROMPTS, plain_greedy
from .helpers.drafts import student


@pytest.mark.parametrize("k", [1, 3])
def test_judged_positions_are_recorded_once_with_their_context_and_target_distribution(target, k):
    ver = RecordingVerifier(TargetVerifier(target, capacity=128), topk=16)
    res = speculative_generate(ver, DraftLMProposer(student(target), k=k), PROMPTS[2], 24, stops=set())
    rec = ver.record.finish(res.tokens)
    assert rec.tokens == PROMPTS[2] + res.tokens
    assert len(set(rec.positions)) == len(rec.positions)  # each position once
    assert rec.num_rejected == sum(1 for r in res.rounds if r.accepted < r.draft_depth) > 0
    assert rec.num_accepted == sum(r.accepted for r in res.rounds)
    with torch.no_grad():
        logp = torch.log_softmax(target(input_ids=torch.tensor([rec.tokens])).logits[0].float(), -1)
    for t, ids, lp in zip(rec.positions, rec.topk_ids, rec.topk_logprobs, strict=True):
        # the target's distribution of token t+1 given tokens[:t+1]: what judged the draft's token there
        torch.testing.assert_close(lp, logp[t, ids], atol=1e-4, rtol=1e-4)
        # greedy: the token that followed (an accepted draft token, or the bonus after a rejection) is the argmax
        assert int(ids[0]) == int(logp[t].argmax()) == rec.tokens[t + 1]
    rejected = [t for t, ok in zip(rec.positions, rec.accepted, strict=True) if not ok]
    assert all(t >= len(PROMPTS[2]) for t in rejected)


def test_a_recorder_that_keeps_no_teacher_judges_the_same_positions(target):
    records = []
    for keep in (True, False):
        ver = RecordingVerifier(TargetVerifier(target, capacity=128), topk=16)
        ver.keep_topk = keep
        res = speculative_generate(ver, DraftLMProposer(student(target), k=2), PROMPTS[2], 24, stops=set())
        records.append(ver.record.finish(res.tokens))
    kept, judged = records
    assert (judged.positions, judged.accepted) == (kept.positions, kept.accepted) and kept.topk_ids
    assert judged.topk_ids == [] and judged.topk_logprobs == []


def module_for(target, draft, loss="fkl"):
    return DraftLMModule(target, draft, loss=build_loss(loss), optimizer=torch.optim.AdamW, teacher="stored")


def rejected_loss(module, batch):
    mask = batch["loss_mask"]
    with torch.no_grad():
        s = module.student_logits(batch, mask)
        t = Teacher(topk_ids=batch["topk_ids"][mask], topk_logprobs=batch["topk_logprobs"][mask])
        return float(module._loss(s, t, batch["labels"][mask])[0])


def test_an_update_lowers_the_divergence_on_the_rejected_positions(target):
    draft = student(target)
    serving = student(target)  # same weights (same seed), served in eval mode
    cfg = OnlineConfig(requests=3, update_every=100, steps=8, batch_size=3, lr=3e-3, replay_accepted=0.0, topk=64)
    module = module_for(target, draft)
    online = OnlineDistiller(module, DraftLMProposer(serving, k=3), TargetVerifier(target, capacity=128), cfg, set(), 2,
                             deploy=lambda: serving.load_state_dict(draft.state_dict()))
    for p in PROMPTS:
        online.serve(p)
    batch = online.buffer.batch(3, 0.0, 2, torch.Generator().manual_seed(0))
    assert int(batch["loss_mask"].sum()) == online.buffer.rejected  # replay 0: the rejected positions only
    before = rejected_loss(module, batch)
    up = online.update()
    after = rejected_loss(module, batch)
    assert up is not None and up.positions > 0 and after < before
    assert torch.equal(serving.lm_head.weight, draft.lm_head.weight)  # deployed
    assert online.version == 1


def test_stopping_rule_stops_when_acceptance_stalls():
    rule = StoppingRule(window=4, patience=2, epsilon=0.01)
    for rate in (0.2, 0.3):
        rule.observe(rate)
    assert rule.should_update()  # the first window is the best so far
    rule.observe(0.6)
    assert rule.should_update() and rule.stale == 0  # the window rose: 0.367
    assert rule.should_update() and rule.stale == 1  # no gain since
    assert not rule.should_update() and rule.stopped  # `patience` updates without a gain: stop
    rule.observe(1.0)
    assert not rule.should_update()  # stopped (no re-arm asked for)


def test_the_engine_rows_judged_positions_and_which_version_they_judge():
    """An engine request row (K=2): the tokens each step emitted, the drafter version loaded before each step. A
    step emitting n accepted n - 1 drafts and rejected the n-th unless all K passed; the last step's tail is
    unknown. A step judges the drafts proposed at the end of the step before, by that step's version."""
    row = {"token_ids": list(range(10, 19)), "steps": [1, 3, 1, 2, 2], "versions": [1, 1, 1, 1, 2]}
    rec = request_record([5, 6], row, k=2)
    # output index o is judged at position prompt_len + o - 1: the outputs 1, 2 | 4 | 5, 6 | 7
    assert rec.positions == [2, 3, 5, 6, 7, 8] and rec.accepted == [True, True, False, True, False, True]
    # version 2 loaded before the last step: it proposed nothing that was judged, so the request is version 1's
    assert version_rate(row, 2, 1) == 4 / 6 and version_rate(row, 2, 2) is None
    # a request the previous version partly drafted (or prefilled: the draft's cache of the prompt) judges neither
    for versions in ([0, 0, 1, 1, 1], [0, 1, 1, 1, 1]):
        assert version_rate({**row, "versions": versions}, 2, 1) is None
        assert version_rate({**row, "versions": versions}, 2, 0) is None


def test_an_update_waits_for_a_request_that_judged_the_deployed_draft_alone(target):
    """The engine serves on while the trainer updates: requests that do not judge the new version alone give the
    stopping rule nothing, so no update is judged (or stopped) on none of that version's requests."""
    cfg = OnlineConfig(requests=3, update_every=1, steps=1, batch_size=1, lr=1e-3, topk=16, window=4, patience=1)
    online = OnlineDistiller(module_for(target, student(target)), DraftLMProposer(student(target), k=2),
                             TargetVerifier(target, capacity=128), cfg, set(), 2)
    _, record = online.serve(PROMPTS[0])
    assert len(online.log.updates) == 1  # the first window is the best so far
    served = online.log.served[-1]
    for _ in range(3):
        online.observe(record, served, None)
    assert len(online.log.updates) == 1 and online.rule.stale == 0 and not online.rule.stopped
    online.observe(record, served, 1.0)  # the new version's own request, a better window
    assert len(online.log.updates) == 2 and not online.rule.stopped


def test_stopping_rule_rearms_when_the_traffic_moves_on():
    rule = StoppingRule(window=2, patience=1, epsilon=0.01, rearm=0.2)
    for rate in (0.6, 0.6):
        rule.observe(rate)
    assert rule.should_update() and not rule.should_update() and rule.stopped  # best 0.6, then no gain
    rule.observe(0.1)
    assert not rule.should_update()  # 0.35: below 0.6 - 0.2, but the window still holds pre-stop traffic
    rule.observe(0.3)
    assert rule.should_update() and not rule.stopped and rule.rearmed == 1  # a full new window at 0.2: learn again
    assert rule.best == pytest.approx(0.2)
    rule.observe(0.5)
    assert rule.should_update() and rule.stale == 0  # 0.4 beats the new level
    assert not rule.should_update() and rule.stopped  # and stalls again
    rule.observe(0.45)
    assert not rule.should_update()  # within `rearm` of 0.4: stays stopped


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_serving_stays_lossless_before_and_after_updates(target, kind):
    cfg = OnlineConfig(requests=3, update_every=1, steps=2, batch_size=2, lr=1e-2, topk=32, patience=100)
    if kind == "draft":
        draft, serving = student(target), student(target)
        module, proposer = module_for(target, draft), DraftLMProposer(serving, k=3)
    else:
        from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
        from specdistill.methods.eagle.training import EagleModule

        from .helpers.drafts import random_head

        draft, serving = random_head(target, "eagle3").train(), random_head(target, "eagle3")
        module = EagleModule(target, draft, ttt_steps=2, loss=build_loss("fkl"), optimizer=torch.optim.AdamW)
        proposer = EagleProposer(serving, EagleTreeConfig(shape="dynamic", depth=3, top_k=2, total_tokens=5))
    online = OnlineDistiller(module, proposer, TargetVerifier(target, capacity=128,
                                                             feature_layers=getattr(proposer, "feature_layers", ())),
                             cfg, set(), 2, deploy=lambda: serving.load_state_dict(draft.state_dict()))
    for prompt in PROMPTS + PROMPTS:
        tokens, _ = online.serve(prompt)
        assert tokens == plain_greedy(target, prompt, cfg.max_new_tokens), (online.version, prompt)
    assert online.version >= 2  # served by updated drafts


def test_buffer_is_bounded_in_tokens(target):
    from specdistill.online.recorder import RequestRecord

    buf = RejectionBuffer(max_tokens=25)
    for i in range(4):
        buf.add(RequestRecord(tokens=list(range(10)), prompt_len=3, positions=[4], accepted=[False],
                              topk_ids=[torch.tensor([i])], topk_logprobs=[torch.tensor([0.0])]))
    assert len(buf) == 2 and buf.tokens == 20 and int(buf.requests[0].topk_ids[0]) == 2  # oldest out first


@pytest.mark.parametrize("scenario", ["code", "chat"])
def test_online_stage_writes_metrics_curves_and_versions(tmp_path, tiny_target_dir, tiny_tokenizer, monkeypatch,
                                                         scenario):
    from specdistill.core.models.target import TargetConfig, load_target
    from specdistill.stages import online as online_stage

    save_code_prompts(tiny_tokenizer, tmp_path / "prompts" / ("humaneval" if scenario == "code" else "val"))
    loaded = load_target(TargetConfig(name_or_path=str(tiny_target_dir), dtype="float32"))
    save_draft(student(loaded.model), tmp_path / "models/draft")
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts"), "models_dir": str(tmp_path / "models"),
                     "metrics_dir": str(tmp_path / "metrics"), "plots_dir": str(tmp_path / "plots")},
           "logger": {"enabled": False}, "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "online": {"requests": 4, "held_out": 2, "max_new_tokens": 12, "update_every": 2, "steps": 2,
                      "batch_size": 2, "topk": 16, "lr": 1e-3, "scenario": scenario, "gate": int(scenario == "chat")}}
    metrics = online_stage.run(cfg)
    saved = read_record(tmp_path / "metrics/online_draft.json")
    assert saved["held_out"]["frozen"]["requests"] == 2 and saved["stream"]["online"]["requests"] == 4
    assert len(saved["updates"]) >= 1 and metrics["time"]["update_s"] > 0
    curve = (tmp_path / "plots/online_draft/curve.csv").read_text().splitlines()
    assert curve[0] == "request,frozen,online,frozen_window,online_window,version" and len(curve) == 7
    assert (tmp_path / "models/online_draft/final/config.json").exists()
    assert any(p.name.startswith("v001-r") for p in (tmp_path / "models/online_draft").iterdir())
    assert saved["scenario"] == scenario
    updates = (tmp_path / "plots/online_draft/updates.csv").read_text().splitlines()
    assert updates[0].endswith(",gate_before,gate_after,deployed") and len(updates) == 1 + len(saved["updates"])
    assert all((row.split(",")[6] != "") is (scenario == "chat") for row in updates[1:])  # gated: scores kept
    cfg["online"]["loss"] = "jsd"
    with pytest.raises(ValueError, match="stored top-k"):
        online_stage.run(cfg)
    cfg["online"].update(loss="fkl", requests=5)
    with pytest.raises(ValueError, match="holds 6 prompts"):
        online_stage.run(cfg)


def test_offline_replay_steps_train_on_the_offline_data_with_a_live_teacher(target, generated):
    from specdistill.core.data.datamodule import DataConfig, DistillDataModule

    dm = DistillDataModule(DataConfig(batch_size=2, bucket_size=1), generated, generated, pad_id=2)
    dm.setup("fit")
    offline = iter(dm.train_dataloader())
    draft, serving = student(target), student(target)
    live = DraftLMModule(target, draft, loss=build_loss("fkl"), optimizer=torch.optim.AdamW)  # teacher: live
    cfg = OnlineConfig(requests=2, update_every=100, steps=2, batch_size=2, lr=1e-3, topk=16, replay_offline=1.0)
    online = OnlineDistiller(module_for(target, draft), DraftLMProposer(serving, k=2), TargetVerifier(target, 128), cfg,
                             set(), 2, deploy=lambda: serving.load_state_dict(draft.state_dict()), offline=offline,
                             offline_module=live)
    online.serve(PROMPTS[0])
    before = draft.lm_head.weight.clone()
    offline_positions = sum(int(b["loss_mask"].sum()) for b in itertools.islice(iter(dm.train_dataloader()), 2))
    up = online.update()  # replay_offline=1: both steps on offline batches (the buffer holds one request)
    assert up is not None and up.positions == offline_positions and not torch.equal(before, draft.lm_head.weight)
    with pytest.raises(ValueError, match="replay_offline"):
        OnlineDistiller(module_for(target, draft), DraftLMProposer(serving, k=2), TargetVerifier(target, 128), cfg,
                        set(), 2)


def test_buffer_gate_holds_the_newest_requests_out_of_training_batches():
    from specdistill.online.recorder import RequestRecord

    buf = RejectionBuffer(max_tokens=1000)
    for i in range(5):  # request i: token i everywhere, one rejected and one accepted position
        buf.add(RequestRecord(tokens=[i] * 8, prompt_len=2, positions=[3, 5], accepted=[False, True],
                              topk_ids=[torch.tensor([i])] * 2, topk_logprobs=[torch.tensor([0.0])] * 2))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = buf.batch(2, 1.0, 99, g, skip_newest=2)
        assert set(batch["input_ids"][:, 0].tolist()) <= {0, 1, 2}  # requests 3 and 4 are the gate's
    gate = buf.newest(2, 99)
    assert gate["input_ids"][:, 0].tolist() == [3, 4]
    assert gate["loss_mask"].sum(1).tolist() == [2, 2]  # every judged position, accepted or not
    assert buf.batch(2, 1.0, 99, g, skip_newest=5) is None and buf.newest(0, 99) is None


def greedy_agreement(target, draft, batch):
    """The share of judged positions where the draft's argmax is the target's: what the gate measures at T=0."""
    mask = batch["loss_mask"]
    with torch.no_grad():
        t = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[mask]
        d = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[mask]
    return float((t.argmax(-1) == d.argmax(-1)).float().mean())


@pytest.mark.parametrize("lr, tolerance, deployed", [(3e-3, 1.0, True), (30.0, 0.0, False)])
def test_the_gate_deploys_an_update_or_rolls_it_back(target, lr, tolerance, deployed):
    draft, serving = student(target), student(target)
    cfg = OnlineConfig(requests=4, update_every=100, gate=2, gate_tolerance=tolerance, steps=6, batch_size=2, lr=lr,
                       replay_accepted=1.0, topk=64)
    module = module_for(target, draft)
    online = OnlineDistiller(module, DraftLMProposer(serving, k=3), TargetVerifier(target, capacity=128), cfg, set(), 2,
                             deploy=lambda: serving.load_state_dict(draft.state_dict()))
    for p in PROMPTS:
        online.serve(p)
    gate = online.buffer.newest(2, 2)
    expected_before = greedy_agreement(target, draft, gate)
    weights = {k: v.clone() for k, v in draft.state_dict().items()}
    up = online.update()
    assert up.gate_before == pytest.approx(expected_before)  # the gate scores what the target's argmax says
    # deployed: the student scores gate_after; rolled back: it scores gate_before again
    assert greedy_agreement(target, draft, gate) == pytest.approx(up.gate_after if deployed else up.gate_before)
    assert up.deployed is deployed and online.version == int(deployed)
    assert torch.equal(serving.lm_head.weight, draft.lm_head.weight)  # serving = student: updated, or rolled back
    unchanged = all(torch.equal(weights[k], v) for k, v in draft.state_dict().items())
    assert unchanged is not deployed
    if not deployed:
        assert up.gate_after < up.gate_before  # lr 30 wrecks the draft: the gate saw it ...
        assert online.optimizer.state_dict()["state"] == {}  # ... and the optimizer forgot the undone steps
    with pytest.raises(ValueError, match="online.gate=8 must be below"):
        OnlineConfig(gate=8, update_every=8)


def test_the_gate_scores_an_eagle_head_on_its_first_draft_step(target):
    from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
    from specdistill.methods.eagle.training import EagleModule

    from .helpers.drafts import random_head

    head, serving = random_head(target, "eagle3").train(), random_head(target, "eagle3")
    module = EagleModule(target, head, ttt_steps=2, loss=build_loss("fkl"), optimizer=torch.optim.AdamW)
    cfg = OnlineConfig(method="eagle", requests=3, update_every=100, gate=1, steps=2, batch_size=2, lr=1e-3, topk=32)
    online = OnlineDistiller(module, EagleProposer(serving, EagleTreeConfig(shape="chain", k=2)),
                             TargetVerifier(target, capacity=128, feature_layers=head.cfg.feature_layers), cfg, set(),
                             2, deploy=lambda: serving.load_state_dict(head.state_dict()))
    for p in PROMPTS:
        online.serve(p)
    scores = module.score(online.buffer.newest(1, 2))
    assert 0 <= scores["alpha_t0"] <= 1 and scores["alpha_pos1_t0"] == pytest.approx(scores["alpha_t0"])
    up = online.update()
    assert up.gate_before == pytest.approx(scores["alpha_t0"]) and up.gate_after is not None
    assert module.score(online.buffer.newest(1, 2)) == module.score(online.buffer.newest(1, 2))  # metrics reset


def test_a_score_memo_runs_the_target_once_for_the_gates_two_scores(target):
    """The gate scores its requests before and after an update against the same frozen target: with a memo
    the target's pass runs once, and the scores are those of a fresh pass (the student changed in between)."""
    from specdistill.methods.eagle.training import EagleModule
    from specdistill.methods.medusa.training import MedusaModule
    from specdistill.online.recorder import RequestRecord

    from .helpers.drafts import random_head, random_heads

    draft = student(target)
    head = random_head(target, "eagle3").train()
    modules = {"draft": module_for(target, draft),
               "eagle": EagleModule(target, head, ttt_steps=2, loss=build_loss("fkl"), optimizer=torch.optim.AdamW),
               "medusa": MedusaModule(target, random_heads(target, 2), loss=build_loss("fkl"),
                                      optimizer=torch.optim.AdamW)}
    buf = RejectionBuffer(max_tokens=1000)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens = torch.randint(3, 60, (12,), generator=g).tolist()
        buf.add(RequestRecord(tokens=tokens, prompt_len=4, positions=[5, 7, 9], accepted=[False, True, False],
                              topk_ids=[torch.tensor([1])] * 3, topk_logprobs=[torch.tensor([0.0])] * 3))
    batch = buf.newest(2, 2)
    calls = []
    hook = target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        for name, module in modules.items():
            calls.clear()
            memo: dict = {}
            before = module.score(batch, memo)
            with torch.no_grad():  # the student changes, as an update would change it
                for p in module.student_parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            after = module.score(batch, memo)
            assert len(calls) == 1, name  # one target pass for both scores
            assert after == module.score(batch) and len(calls) == 2, name  # a fresh pass scores the same
            assert after != before, name  # and the memo held the target's pass, not the first score
            assert module._target_memo is None  # nothing memoised outside score()
            with pytest.raises(ValueError, match="another batch's target pass"):
                module.score(buf.newest(1, 2), memo)  # a memo kept for one batch never scores another
    finally:
        hook.remove()
