"""The benchmark runner and the evaluate stage on tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdistill.core.records import read_record
from specdistill.evaluation.accounting import Tally, expected_accepted_length, speedup_interval
from specdistill.evaluation.runner import Conversation, hf_method, our_method, run_benchmark
from specdistill.methods.draft.proposer import DraftLMProposer
from specdistill.methods.lookup.proposer import PromptLookupProposer
from specdistill.stages import evaluate as evaluate_stage
from specdistill.stages.prepare import save_split

from .helpers.data import save_mtbench
from .helpers.models import make_model


def test_tally_sums_counts_before_dividing():
    t = Tally()
    t.add(10, 1.0, forwards=5, attempts=[5, 3], accepts=[3, 1])
    t.add(2, 1.0, forwards=2, attempts=[2], accepts=[0])
    s = t.summary(ar=Tally(tokens=12, seconds=4.0))
    assert s["tau"] == round(12 / 7, 4)  # not the mean of 2.0 and 1.0
    assert s["alpha_pos1"] == round(3 / 7, 4) and s["alpha_pos2"] == round(1 / 3, 4)
    assert (s["attempts_pos1"], s["attempts_pos2"]) == (7, 3)  # what each share is out of
    assert s["speedup"] == 2.0


def test_speedup_interval_is_paired_and_covers_the_true_ratio():
    """Prompts whose lengths and times vary tenfold, each method 2x the AR speed on every prompt up to
    5% timing noise: pairing keeps the interval tight around 2 (an unpaired one would span the prompt
    spread); over simulated runs of 8 generations with a known ratio, the 95% interval covers it
    93-95% of the time (a percentile bootstrap gave 87% here, and fails the lower bound)."""
    rng = np.random.default_rng(1)

    def run(n, ratio=2.0, noise=0.05):
        ar_s = rng.uniform(0.5, 5.0, n)
        tokens = (ar_s * 20).astype(int) + 1
        spec_s = ar_s / ratio * rng.lognormal(-noise**2 / 2, noise, n)  # mean-one noise: the true ratio is `ratio`
        return list(zip(tokens, spec_s, strict=True)), list(zip(tokens, ar_s, strict=True))

    spec, ar = run(10)
    lo, hi = speedup_interval(spec, ar)
    t = Tally()
    for tok, sec in spec:
        t.add(int(tok), float(sec))
    a = Tally()
    for tok, sec in ar:
        a.add(int(tok), float(sec))
    s = t.summary(a)
    assert 1.85 < lo <= s["speedup"] <= hi < 2.15 and s["speedup_ci95"] == [lo, hi]
    assert speedup_interval(spec, ar[:-1]) is None  # unpaired: no interval
    assert speedup_interval([(0, 1.0), (0, 1.0)], [(0, 1.0), (0, 1.0)]) is None  # no tokens: no ratio, not NaN
    covered = sum(lo <= 2.0 <= hi for lo, hi in (speedup_interval(*run(8, noise=0.2)) for _ in range(1000)))
    assert 0.91 <= covered / 1000 <= 0.975, covered


def test_expected_accepted_length():
    e = expected_accepted_length(0.5, 3)
    assert e["truncated_sum"] == 1 + 0.5 + 0.25 + 0.125 and e["geometric_limit"] == 2.0


@pytest.fixture(scope="module")
def pair(tiny_tokenizer):
    return make_model(len(tiny_tokenizer), seed=0), make_model(len(tiny_tokenizer), seed=0)


def test_runner_all_methods_agree_at_temperature_zero(pair, tiny_tokenizer):
    target, draft = pair
    stops = {tiny_tokenizer.eos_token_id}
    methods = [our_method("ar", target, None, 12, stops, 256, 4),
               hf_method("hf_generate", target, 12, stops, 2),
               our_method("spec", target, DraftLMProposer(draft, k=4), 12, stops, 256, 4),
               hf_method("hf_assisted", target, 12, stops, 2, assistant=draft, k=4),
               our_method("lookup", target, PromptLookupProposer(4), 12, stops, 256, 4)]

    def encode(messages):
        text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

    data = {"mtbench": [Conversation("1", ["Write a poem about the sea.", "Now shorter."])],
            "humaneval": [Conversation("h", ["def add(a, b):"])]}
    res = run_benchmark(methods, data, [0.0, 1.0], 1.0, 0, encode, tiny_tokenizer.decode)
    for ds in ("mtbench", "humaneval"):
        texts = {}
        for s in res.samples:
            if s["dataset"] == ds and s["temperature"] == 0.0:
                texts.setdefault((s["id"], s["turn"]), set()).add(s["text"])
        assert all(len(v) == 1 for v in texts.values()), texts  # lossless: one answer per turn
    ar = res.tallies[("mtbench", "T0", "ar")].summary()
    spec = res.tallies[("mtbench", "T0", "spec")].summary()
    assert ar["tau"] == 1.0 and spec["tau"] > 2.0 and spec["alpha_pos1"] == 1.0
    assert res.tallies[("mtbench", "T0", "ar")].generations == 2  # both MT-bench turns


def test_evaluate_stage_writes_metrics_and_plots(tmp_path, tiny_target_dir, tiny_tokenizer, monkeypatch):
    rows = lambda src, turns_list: [{"id": str(i), "messages": [{"role": "user", "content": t[0]}], "source": src,  # noqa: E731
                                     "category": "x", "reference": "", "turns": t, "prompt": "", "prompt_tokens": 1}
                                    for i, t in enumerate(turns_list)]
    save_split(rows("mtbench", [["Write a poem.", "Shorter."], ["What is Paris?", "And France?"]]),
               tmp_path / "prompts/mtbench")
    save_split(rows("humaneval", [["def f(x):"]]), tmp_path / "prompts/humaneval")
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "decode": {"draft": {"path": None, "layers": 1}},
           "eval": {"method": "draft", "num_prompts": 2, "max_new_tokens": 6, "temperatures": [0.0],
                    "k": 3, "hf_baselines": True, "beside": ["lookup"]}}  # as evals.draft sets it
    metrics = evaluate_stage.run(cfg)
    saved = read_record(tmp_path / "metrics/draft.json")
    headline = json.loads((tmp_path / "metrics/draft.json").read_text())  # what `dvc metrics show` prints
    spec = [saved["results"][ds]["T0"]["spec"] for ds in ("mtbench", "humaneval")]
    assert headline == {"tau_t0": round((spec[0]["tau"] + spec[1]["tau"]) / 2, 4),
                        "speedup": round((spec[0]["speedup"] * spec[1]["speedup"]) ** 0.5, 4)}
    assert saved["results"] == json.loads(json.dumps(metrics["results"]))
    m = saved["results"]["mtbench"]["T0"]
    assert set(m) == {"ar", "hf_generate", "spec", "hf_assisted", "lookup"}
    assert m["ar"]["speedup"] == 1.0 and "speedup_vs_hf_assisted" in m["spec"]
    for key in ("method", "k", "temperatures", "max_new_tokens", "dtype", "torch", "transformers", "device", "seed"):
        assert key in saved["settings"], key
    assert (tmp_path / "plots/draft/alpha_by_position.csv").read_text().startswith("setting,method,position,alpha")
    assert (tmp_path / "plots/draft/speed.csv").exists()


def test_evaluate_stage_writes_where_paths_say(tmp_path, tiny_target_dir, monkeypatch):
    """paths.metrics_dir / paths.plots_dir move the outputs, as they do for online and report."""
    save_mtbench(tmp_path / "prompts", ("Hi",))
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts"), "metrics_dir": str(tmp_path / "side/m"),
                     "plots_dir": str(tmp_path / "side/p")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "eval": {"method": "lookup", "datasets": ["mtbench"], "num_prompts": 1, "max_new_tokens": 4,
                    "temperatures": [0.0], "hf_baselines": False}}
    evaluate_stage.run(cfg)
    assert (tmp_path / "side/m/lookup.json").exists() and (tmp_path / "side/p/lookup/speed.csv").exists()
    assert not (tmp_path / "metrics").exists() and not (tmp_path / "plots").exists()


def test_evaluate_stage_on_the_dev_prompts(tmp_path, tiny_target_dir, monkeypatch):
    """eval.split=dev runs other prompts than the test ones and records it; a dev set that would meet the
    test prompts fails before the target loads, with nothing written."""
    from specdistill.core.errors import ConfigError

    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": t}], "source": "mtbench", "category": "x",
             "reference": "", "turns": [t], "prompt": "", "prompt_tokens": 1} for i, t in enumerate(["Hi", "Bye"])]
    save_split(rows, tmp_path / "prompts/mtbench")
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir / "missing"), "dtype": "float32"},
           "eval": {"method": "lookup", "datasets": ["mtbench"], "num_prompts": 2, "max_new_tokens": 4,
                    "temperatures": [0.0], "hf_baselines": False, "split": "dev"}}
    with pytest.raises(ConfigError, match="would overlap its 2 test prompts"):
        evaluate_stage.run(cfg)  # the target path does not exist: the prompts were checked first
    assert not (tmp_path / "metrics").exists()
    cfg["eval"]["num_prompts"], cfg["target"]["name_or_path"] = 1, str(tiny_target_dir)
    metrics = evaluate_stage.run(cfg)
    assert metrics["settings"]["split"] == "dev"
    ids = {json.loads(line)["id"] for line in (tmp_path / "plots/lookup/samples.jsonl").read_text().splitlines()}
    assert ids == {"q1"}  # the test prompt is q0


def test_evaluate_stage_on_the_held_out_prompts_of_the_training_source(tmp_path, tiny_target_dir, monkeypatch):
    """eval.datasets may name `val`, prepare's held-out prompts of the training source (a user's own domain when
    `data=` is theirs): it is measured as a benchmark is, every user turn of a multi-turn context answered."""
    rows = [{"id": f"c{i}#{len(t)}", "messages": [{"role": "user", "content": t[0]}], "source": "sharegpt",
             "category": "multi_turn" if len(t) > 1 else "single_turn", "reference": "x", "turns": t, "prompt": "",
             "prompt_tokens": 1} for i, t in enumerate([["Hello there."], ["Name a colour.", "Another one."]])]
    save_split(rows, tmp_path / "prompts/val")
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "eval": {"method": "lookup", "datasets": ["val"], "num_prompts": 2, "max_new_tokens": 4,
                    "temperatures": [0.0], "hf_baselines": False}}
    metrics = evaluate_stage.run(cfg)
    assert set(metrics["results"]) == {"val"}
    samples = [json.loads(line) for line in (tmp_path / "plots/lookup/samples.jsonl").read_text().splitlines()]
    assert {(s["id"], s["turn"]) for s in samples if s["method"] == "ar"} == {("c0#1", 1), ("c1#2", 1), ("c1#2", 2)}


@pytest.mark.parametrize(("datasets", "match"), [([], "name at least one prompt set"),
                                                 (["mtbench", "train"], "distilled on"),
                                                 (["val", "val"], "names a set twice")])
def test_eval_sets_are_checked_at_start(datasets, match):
    """No set, the drafts' own training prompts, or a set twice: refused by evaluate and serve before anything loads,
    the key named."""
    from specdistill.core.config import section
    from specdistill.core.errors import ConfigError
    from specdistill.engine.serving import ServeConfig

    from .helpers.config import composed

    with pytest.raises(ConfigError, match=rf"eval\.datasets=.*{match}|eval\.datasets.*{match}"):
        evaluate_stage.EvalConfig(method="lookup", datasets=datasets)
    with pytest.raises(ConfigError, match=rf"serve\.datasets.*{match}"):
        section(ServeConfig, {**composed()["serve"], "datasets": datasets}, "serve")


def test_a_conversation_is_measured_once_by_its_longest_context():
    """prepare writes a conversation's first k user turns as rows <conv>#1..#k (val): measured, their shared first
    turn would count twice; the benchmarks' ids have no such suffix and keep every row."""
    from specdistill.evaluation.prompts import one_per_conversation

    assert one_per_conversation(["a#1", "a#2", "b#1", "c#2", "c#1"], [1, 2, 1, 2, 1]) == [1, 2, 3]
    assert one_per_conversation(["81", "82", "HumanEval/0"], [2, 2, 1]) == [0, 1, 2]


def test_a_prompt_set_prepare_did_not_write_is_named_with_those_it_did(tmp_path):
    from specdistill.evaluation.prompts import load_conversations

    save_mtbench(tmp_path)
    (tmp_path / "train").mkdir()  # not offered: the drafts were trained on it
    with pytest.raises(FileNotFoundError, match="holds mtbench; name one of those"):
        load_conversations(tmp_path, "my_traffic", 1)
    with pytest.raises(FileNotFoundError, match="run the prepare stage first"):
        load_conversations(tmp_path, "val", 1)


def test_prompts_take_categories_in_turn_and_dev_never_meets_test(tmp_path):
    """MT-bench is stored ten questions a category: the first prompts must not all be writing; the dev prompts
    (where settings are tuned) must have the test prompts' mix of categories (a union's speed-up runs from 1.5x
    to 3.9x by category) and never meet the test prompts that are reported."""
    from collections import Counter

    from specdistill.core.errors import ConfigError

    cats = ["writing"] * 4 + ["math"] * 4 + ["code"] * 3
    assert evaluate_stage.stratified_order(cats) == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7]
    assert evaluate_stage.stratified_order(cats, from_end=True) == [3, 7, 10, 2, 6, 9, 1, 5, 8, 0, 4]
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}], "source": "mtbench", "category": c,
             "reference": "", "turns": [f"q{i}"], "prompt": "", "prompt_tokens": 1} for i, c in enumerate(cats)]
    save_split(rows, tmp_path / "mtbench")

    def ids(split: str, n: int, test_n: int | None = None) -> list[str]:
        return [c.id for c in evaluate_stage.load_conversations(tmp_path, "mtbench", n, split, test_n)]

    assert ids("test", 3) == ["0", "4", "8"]  # one of each category
    assert ids("dev", 3) == ["3", "7", "10"]  # each category's last
    for n in range(1, 6):
        test, dev = ids("test", n), ids("dev", n)
        assert not set(test) & set(dev)
        assert Counter(cats[int(i)] for i in test) == Counter(cats[int(i)] for i in dev)
    with pytest.raises(ConfigError, match="would overlap its 6 test prompts"):
        ids("dev", 6)  # code has 3 rows: its test and dev prompts would share one
    # a benchmark's dev count differs from the reported num_prompts: dev must clear the reported ones
    assert ids("dev", 2, test_n=6) == ["3", "7"]
    with pytest.raises(ConfigError, match="would overlap its 8 test prompts"):
        ids("dev", 4, test_n=8)  # the 8 test prompts hold row 2, the fourth dev one
    with pytest.raises(ConfigError, match="eval.split"):
        evaluate_stage.EvalConfig(split="train")


def test_unknown_method_fails_at_start():
    from specdistill.core.errors import ConfigError

    with pytest.raises(ConfigError, match="eval.method"):
        evaluate_stage.EvalConfig(method="medusa2")


def test_draft_with_another_vocabulary_is_refused(pair):
    from specdistill.methods.draft.model import DraftError, check_same_vocabulary

    other = make_model(50, seed=1)
    with pytest.raises(DraftError, match="vocabulary"):
        check_same_vocabulary(other, pair[0])
