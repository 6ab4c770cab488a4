"""Prompt sets: truncated-JSON recovery, contexts, filtering, the on-disk contract, the prepare stage."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest

from specdistill.core.data.prompts import (
    PrepareConfig,
    PromptError,
    SourceConfig,
    build_train_val,
    contexts,
    recover_json_array,
)
from specdistill.stages import prepare as prepare_stage

CONTRACT = {"id", "messages", "source", "category"}


def conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def sharegpt_records(n: int):
    out = []
    for i in range(n):
        out.append(conv(f"c{i}", ("human", f"Question number {i} about the sea?"), ("gpt", f"Answer {i}."),
                        ("human", f"And a follow-up {i}?"), ("gpt", f"Second answer {i}.")))
    return out


def test_recovers_every_complete_record_of_a_truncated_file():
    full = json.dumps(sharegpt_records(5), indent=2)
    cut = full[: full.index('"c4"') + 20]  # inside the last record
    rec = recover_json_array(cut)
    assert [r["id"] for r in rec.records] == ["c0", "c1", "c2", "c3"]
    assert rec.dropped_records == 1 and rec.dropped_bytes > 0
    whole = recover_json_array(full)
    assert len(whole.records) == 5 and whole.dropped_records == 0 and whole.dropped_bytes == 0
    with pytest.raises(PromptError, match="not a JSON array"):
        recover_json_array('{"a": 1}')


def test_contexts_end_in_a_user_turn_and_clean_chunked_conversations():
    from specdistill.core.data.prompts import _normalise

    turns = _normalise([("human", ""), ("gpt", "orphan answer"), ("human", "Q1"), ("human", "more"),
                        ("gpt", "A1"), ("human", "Q2"), ("gpt", "A2"), ("human", "Q3")])
    ctx = list(contexts("x", turns, max_turns=2))
    assert [c["messages"][-1]["content"] for c in ctx] == ["Q1\n\nmore", "Q2"]
    assert all(c["messages"][-1]["role"] == "user" for c in ctx)
    assert [c["reference"] for c in ctx] == ["A1", "A2"]
    assert ctx[1]["turns"] == ["Q1\n\nmore", "Q2"]
    assert len(list(contexts("x", turns, max_turns=5))) == 3


def prep_cfg(**kw):
    base = dict(source=SourceConfig(), mtbench_path="", humaneval_path="", num_train=1000, num_val=1000,
                val_fraction=0.2, max_turns=2, min_prompt_tokens=1, max_prompt_tokens=512, seed=0)
    base.update(kw)
    return PrepareConfig(**base)


def pairs(records):
    from specdistill.core.data.prompts import _normalise

    return [(r["id"], _normalise((t["from"], t["value"]) for t in r["conversations"])) for r in records]


def test_split_is_deterministic_deduplicated_and_by_conversation(tiny_tokenizer):
    recs = sharegpt_records(60) + [conv("dup", ("human", "Question number 3 about the sea?"), ("gpt", "x"))]
    train, val, stats = build_train_val(pairs(recs), prep_cfg(), tiny_tokenizer, "sharegpt")
    assert stats["duplicates"] == 1
    assert len(train) + len(val) == 120
    conv_of = lambda rows: {r["id"].split("#")[0] for r in rows}  # noqa: E731
    assert not conv_of(train) & conv_of(val)
    again = build_train_val(pairs(recs), prep_cfg(), tiny_tokenizer, "sharegpt")
    assert [r["id"] for r in again[0]] == [r["id"] for r in train]
    assert {r["category"] for r in train} == {"single_turn", "multi_turn"}
    for r in train:
        assert CONTRACT <= set(r) and r["messages"][-1]["role"] == "user"
        assert r["prompt"].endswith("<|im_start|>assistant\n") and r["prompt_tokens"] > 0


def test_length_filter_and_empty_result_is_an_error(tiny_tokenizer):
    with pytest.raises(PromptError, match="no prompts left"):
        build_train_val(pairs(sharegpt_records(10)), prep_cfg(max_prompt_tokens=2), tiny_tokenizer, "s")
    everything, _, _ = build_train_val(pairs(sharegpt_records(40)), prep_cfg(), tiny_tokenizer, "s")
    cap = sorted(r["prompt_tokens"] for r in everything)[len(everything) // 2]
    train, _, stats = build_train_val(pairs(sharegpt_records(40)), prep_cfg(max_prompt_tokens=cap), tiny_tokenizer, "s")
    assert stats["too_long"] > 0 and all(r["prompt_tokens"] <= cap for r in train)


@pytest.fixture
def tiny_assets(tmp_path):
    d = tmp_path / "assets"
    (d / "sharegpt").mkdir(parents=True)
    text = json.dumps(sharegpt_records(50), indent=2)
    (d / "sharegpt/sg.json").write_text(text[: len(text) - 40])  # cut off, like the pinned file
    (d / "mtbench").mkdir()
    (d / "mtbench/question.jsonl").write_text("\n".join(
        json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"Write {i}", f"Rewrite {i}"]})
        for i in range(5)) + "\n")
    (d / "humaneval").mkdir()
    with gzip.open(d / "humaneval/HumanEval.jsonl.gz", "wt") as f:
        for i in range(3):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n",
                                "canonical_solution": "  return x\n"}) + "\n")
    return d


def prepare_cfg(tmp_path, assets, target_dir, **data):
    d = {"source": {"kind": "sharegpt_json", "path": str(assets / "sharegpt/sg.json"), "name": None, "config": None,
                    "split": "train", "data_files": None, "format": "sharegpt",
                    "columns": {"id": "id", "conversation": "conversations"}},
         "mtbench_path": str(assets / "mtbench/question.jsonl"),
         "humaneval_path": str(assets / "humaneval/HumanEval.jsonl.gz"),
         "num_train": 30, "num_val": 5, "num_mtbench": 80, "num_humaneval": 164, "val_fraction": 0.2,
         "max_turns": 2, "min_prompt_tokens": 1, "max_prompt_tokens": 256, "min_reference_chars": 1, "seed": 0}
    d.update(data)
    return {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "data": d,
            "target": {"name_or_path": str(target_dir), "dtype": "float32"}}


def test_prepare_stage_writes_every_split(tmp_path, tiny_assets, tiny_target_dir, caplog):
    summary = prepare_stage.run(prepare_cfg(tmp_path, tiny_assets, tiny_target_dir))
    assert "cut off inside its last record: recovered 49" in caplog.text
    out = tmp_path / "prompts"
    for split, n in {"train": 30, "val": 5, "mtbench": 5, "humaneval": 3}.items():
        ds = datasets.load_from_disk(str(out / split))
        assert len(ds) == n and CONTRACT <= set(ds.column_names), split
        assert summary["splits"][split]["prompts"] == n
    mt = datasets.load_from_disk(str(out / "mtbench"))[0]
    assert mt["turns"] == ["Write 0", "Rewrite 0"] and mt["messages"] == [{"role": "user", "content": "Write 0"}]
    he = datasets.load_from_disk(str(out / "humaneval"))[0]
    assert he["category"] == "code" and "def f0(x):" in he["messages"][0]["content"]


def test_any_datasets_source_by_config(tmp_path, tiny_assets, tiny_target_dir):
    rows = [{"qid": f"q{i}", "msgs": [{"role": "user", "content": f"Tell me about topic {i}"},
                                      {"role": "assistant", "content": f"Topic {i} is nice."}]} for i in range(40)]
    path = tmp_path / "local.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = prepare_cfg(tmp_path, tiny_assets, tiny_target_dir, num_train=20, num_val=3)
    cfg["data"]["source"] = {"kind": "datasets", "path": None, "name": "json", "config": None, "split": "train",
                             "data_files": str(path), "format": "messages",
                             "columns": {"id": "qid", "conversation": "msgs"}}
    prepare_stage.run(cfg)
    train = datasets.load_from_disk(str(tmp_path / "prompts/train"))
    assert len(train) == 20 and train[0]["source"] == "json" and train[0]["id"].startswith("q")


def test_unknown_data_key_fails_at_start(tmp_path, tiny_assets, tiny_target_dir):
    from specdistill.core.errors import ConfigError

    cfg = prepare_cfg(tmp_path, tiny_assets, tiny_target_dir, num_trian=5)
    with pytest.raises(ConfigError, match="num_trian"):
        prepare_stage.run(cfg)


def test_a_missing_prompt_split_names_the_stage_to_run(tmp_path):
    from specdistill.evaluation.prompts import load_prompts

    with pytest.raises(FileNotFoundError, match=r"val is missing: run the prepare stage first \(`dvc repro prepare`\)"):
        load_prompts(tmp_path, "val")


def coding_records(n: int):
    return [conv(f"k{i}", ("human", f"Write a function number {i}."),
                 ("gpt", f"Here it is:\n```python\ndef f{i}(x):\n    return x + {i}\n```")) for i in range(n)]


def test_code_fraction_sets_the_train_mix_and_leaves_val_alone(tiny_tokenizer):
    from specdistill.core.data.prompts import looks_like_code, mix_summary

    recs = sharegpt_records(60) + coding_records(60)  # 120 chat contexts, 60 code ones
    natural, val0, _ = build_train_val(pairs(recs), prep_cfg(num_train=40), tiny_tokenizer, "s")
    for frac in (0.0, 0.25, 0.75, 1.0):
        train, val, _ = build_train_val(pairs(recs), prep_cfg(num_train=40, code_fraction=frac), tiny_tokenizer, "s")
        assert len(train) == 40 and len({r["id"] for r in train}) == 40
        assert mix_summary(train)["code"] == round(40 * frac)
        assert [r["id"] for r in val] == [r["id"] for r in val0]  # val: the source's mix, untouched
        assert sum(r["id"].startswith("k") for r in train) == round(40 * frac)  # the markers found the code ones
    assert 0 < mix_summary(natural)["code"] < 40  # null keeps the source's mix, code and chat alike
    for code in ("    import numpy as np", "import os", "from a.b import c", "def f(x):", "class A(B):",
                 "SELECT name\nFROM users;", "function add(a, b) {", "#include <stdio.h>",
                 "import React from 'react';"):
        assert looks_like_code(code), code
    for prose in ("Define a class of problems, and import goods from France.", "Intro:\nfrom France we went on",
                  "class struggle is old", "the function f(x) is convex", "import duties rose in 2020, and",
                  "SELECT a committee; the rest is FROM memory"):
        assert not looks_like_code(prose), prose


def test_train_offset_draws_fresh_prompts_after_the_first_draw(tiny_tokenizer):
    recs = sharegpt_records(60) + coding_records(60)
    first, val0, _ = build_train_val(pairs(recs), prep_cfg(num_train=30), tiny_tokenizer, "s")
    both, _, _ = build_train_val(pairs(recs), prep_cfg(num_train=50), tiny_tokenizer, "s")
    fresh, val, _ = build_train_val(pairs(recs), prep_cfg(num_train=20, train_offset=30), tiny_tokenizer, "s")
    ids = lambda rows: [r["id"] for r in rows]  # noqa: E731
    assert ids(fresh) == ids(both)[30:]  # the same order, continued: num_train=30 then these 20 = num_train=50
    assert not set(ids(fresh)) & set(ids(first)) and ids(val) == ids(val0)
    mixed, _, _ = build_train_val(pairs(recs), prep_cfg(num_train=20, train_offset=30, code_fraction=0.5),
                                  tiny_tokenizer, "s")
    assert not set(ids(mixed)) & set(ids(first)) and sum(i.startswith("k") for i in ids(mixed)) == 10
    with pytest.raises(PromptError, match=r"data.train_offset=-1: give the number of drawn train prompts to skip"):
        prep_cfg(train_offset=-1)
    with pytest.raises(PromptError, match=r"data.train_offset=500 skips all \d+ train prompts .* lower it"):
        build_train_val(pairs(recs), prep_cfg(train_offset=500), tiny_tokenizer, "s")


def test_a_code_fraction_the_source_cannot_give_names_the_fix(tiny_tokenizer):
    recs = sharegpt_records(60) + coding_records(5)
    with pytest.raises(PromptError, match=r"needs 20 with code and 20 without; the source has \d+ and \d+ after "
                                          "filtering. Lower data.num_train, or move data.code_fraction"):
        build_train_val(pairs(recs), prep_cfg(num_train=40, code_fraction=0.5), tiny_tokenizer, "s")
    few_chat = sharegpt_records(3) + coding_records(60)  # too little chat for a share of 0
    with pytest.raises(PromptError, match=r"needs 0 with code and 40 without"):
        build_train_val(pairs(few_chat), prep_cfg(num_train=40, code_fraction=0.0), tiny_tokenizer, "s")
    with pytest.raises(PromptError, match=r"code_fraction=1.5: give a share in \[0, 1\]"):
        prep_cfg(code_fraction=1.5)


def test_prepare_stage_records_the_code_mix_only_when_asked(tmp_path, tiny_assets, tiny_target_dir):
    plain = prepare_stage.run(prepare_cfg(tmp_path, tiny_assets, tiny_target_dir))
    assert "code_mix" not in plain  # a default run's prompts and summary stay as they were
    summary = prepare_stage.run(prepare_cfg(tmp_path / "mix", tiny_assets, tiny_target_dir, code_fraction=0.0))
    assert summary["code_mix"]["train"] == {"prompts": 30, "code": 0, "code_share": 0.0}
    assert json.loads((tmp_path / "mix/prompts/summary.json").read_text())["code_mix"]["val"]["code"] == 0


def test_a_file_corrupt_in_the_middle_is_an_error_not_a_truncation():
    """Issue 33, item 5: a record broken in the middle was once taken for a cut-off end (26 of 80 kept)."""
    full = json.dumps(sharegpt_records(80), indent=2)
    broken = full.replace('"c26"', '"c26" "oops"', 1)
    with pytest.raises(PromptError, match=r"record 26 .*corrupt in the middle"):
        recover_json_array(broken)
    # a nested turn after the cut is not mistaken for a following record
    cut = full[: full.index('"c79"') + 120]
    assert len(recover_json_array(cut).records) == 79


def test_a_broken_record_boundary_or_a_single_object_is_an_error_not_a_truncation():
    """Second hardening round: one byte turning the ',' between two records into ']' kept 20 of 80 records with no
    warning; corruption followed by records with other keys was reported as a cut-off tail (51 lost under "dropped 1
    partial record"); a single object was read from its first '['. Only a cut-off end is recovered."""
    records = sharegpt_records(80)
    full = json.dumps(records, indent=2)
    boundary = full.index('"c20"')
    boundary = full.rindex(",", 0, boundary)  # the ',' between records 19 and 20
    with pytest.raises(PromptError, match=r"closes after record 19 .*corrupt in the middle"):
        recover_json_array(full[:boundary] + "]" + full[boundary + 1:])
    with pytest.raises(PromptError, match=r"after record 19, .* where ',' or '\]' goes"):
        recover_json_array(full[:boundary] + " " + full[boundary + 1:])
    for r in records[30:]:  # the records after the damage have other keys than the first
        r["extra"] = 1
    other = json.dumps(records, indent=2).replace('"c28"', '"c28" "oops"', 1)
    with pytest.raises(PromptError, match=r"record 28 .*corrupt in the middle"):
        recover_json_array(other)
    with pytest.raises(PromptError, match=r"not a JSON array.*single object"):
        recover_json_array(json.dumps({"data": records[:3]}))
    with pytest.raises(PromptError, match=r"record 0 .*not a conversation"):
        recover_json_array("[[1, 2]]")
    # cut anywhere inside the last record (a string, a number, a literal, between keys): recovered, with a count
    for cut in (full[: full.rindex('"c79"') + 3], full[: full.rindex("Second answer 79") + 5], full[:-3],
                json.dumps(records[:2])[:-1] + ', {"id": "x", "ok": tr'):
        rec = recover_json_array(cut)
        assert rec.dropped_records == 1 and len(rec.records) in (79, 2), cut[-30:]


def test_bad_prompt_files_name_the_file_and_the_fix(tmp_path, tiny_assets, tiny_target_dir):
    cases = {
        "sharegpt/sg.json": (b'[{"id": "x\xff\xfe", "conversations": []}]', r"sg.json is not UTF-8 text"),
        "mtbench/question.jsonl": (b'{"question_id": 1, "category": "w", "turns": ["a"]}\n' * 2
                                   + b'{"question_id": 3, "turns": \n', r"question.jsonl line 3 is not an MT-bench"),
        "humaneval/HumanEval.jsonl.gz": (b'{"task_id": "HumanEval/0"}\n', r"HumanEval.jsonl.gz is not a gzip"),
    }
    for name, (content, message) in cases.items():
        good = (tiny_assets / name).read_bytes()
        (tiny_assets / name).write_bytes(content)
        with pytest.raises(PromptError, match=message):
            prepare_stage.run(prepare_cfg(tmp_path, tiny_assets, tiny_target_dir))
        (tiny_assets / name).write_bytes(good)


def test_a_custom_row_of_the_wrong_shape_names_the_row_and_the_keys(tmp_path, tiny_assets, tiny_target_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "messages": [{"from": "human", "value": "hi"}]}) + "\n")
    cfg = prepare_cfg(tmp_path, tiny_assets, tiny_target_dir)
    cfg["data"]["source"] = {"kind": "datasets", "path": None, "name": "json", "config": None, "split": "train",
                             "data_files": str(rows), "format": "messages",
                             "columns": {"id": "id", "conversation": "messages"}}
    with pytest.raises(PromptError, match=r"row 0 .*'messages' shape .*KeyError.*data.source.format"):
        prepare_stage.run(cfg)


def test_prompts_must_fit_the_targets_context(tmp_path, tiny_assets, tiny_target_dir, caplog):
    """The tiny target has 512 positions: a cap at or above it is refused, a longer benchmark prompt dropped."""
    with pytest.raises(PromptError, match=r"data.max_prompt_tokens=512 leaves no room .*context of 512"):
        prepare_stage.run(prepare_cfg(tmp_path, tiny_assets, tiny_target_dir, max_prompt_tokens=512))
    lines = (tiny_assets / "mtbench/question.jsonl").read_text().splitlines()
    lines.append(json.dumps({"question_id": 99, "category": "writing", "turns": ["word " * 600, "again"]}))
    (tiny_assets / "mtbench/question.jsonl").write_text("\n".join(lines) + "\n")
    summary = prepare_stage.run(prepare_cfg(tmp_path, tiny_assets, tiny_target_dir, max_prompt_tokens=256))
    assert summary["splits"]["mtbench"]["prompts"] == 5
    assert "mtbench: dropped 1 prompt(s) longer than the target's context of 512" in caplog.text
