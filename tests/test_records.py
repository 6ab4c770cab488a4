"""Headline metrics beside the whole record: what DVC prints stays a screen wide, nothing is lost."""

from __future__ import annotations

import json

from specdistill.core.records import (
    code_version,
    headline_of_serving,
    headline_of_training,
    read_record,
    read_records,
    write_record,
)


def test_the_headline_holds_a_few_numbers_and_the_record_everything(tmp_path):
    record = {"settings": {"cpu": "x", "threads": 2}, "results": {"mtbench": {"T0": {"spec": {"tau": 1.5}}}}}
    write_record(tmp_path / "eagle.json", record, {"mtbench": {"T0": {"tau": 1.5}}})
    assert json.loads((tmp_path / "eagle.json").read_text()) == {"mtbench": {"T0": {"tau": 1.5}}}
    written = {**record, "settings": {**record["settings"], "code": code_version()}}  # the record names its code
    assert read_record(tmp_path / "eagle.json") == written == read_records(tmp_path)["eagle"]
    (tmp_path / "old.json").write_text(json.dumps(record))  # written before the split: its own record
    assert read_record(tmp_path / "old.json") == record and set(read_records(tmp_path)) == {"eagle", "old"}


def test_training_and_serving_headlines():
    train = {"steps": 640, "final": {"val/alpha": 0.31234, "val/alpha_t0": 0.3, "val/tau_sim_t0": 1.48,
                                     "val/head1_top1": 0.2}}
    assert headline_of_training(train) == {"alpha_t0": 0.3, "tau_sim_t0": 1.48}
    serve = {"chosen_k": {"c1": {"k": 1, "speedup_geomean": 1.01}, "c16": {"k": 1, "speedup_geomean": 0.57}},
             "deploy": {"speedup_geomean": {"c1": 0.95}}}
    assert headline_of_serving(serve) == {"c1": 0.95, "c16": 0.57}  # the deployed schedule's, else the best K's


def test_the_evaluation_headline_is_the_runs_own_draft_in_two_numbers():
    from specdistill.core.records import headline_of_evaluation

    cell = lambda tau, speedup: {"spec": {"tau": tau, "speedup": speedup}, "ar": {"tau": 1.0, "speedup": 1.0},  # noqa: E731
                                 "dflash": {"tau": 9.0, "speedup": 9.0}}  # a rival: the record's, not the headline's
    run = {"results": {"mtbench": {"T0": cell(1.5, 1.2), "T1": cell(1.3, 0.8)},
                       "humaneval": {"T0": cell(1.7, 1.25), "T1": cell(1.4, 1.2)}}}
    assert headline_of_evaluation(run) == {"tau_t0": 1.6, "speedup": round((1.2 * 0.8 * 1.25 * 1.2) ** 0.25, 4)}
    sampled_only = {"results": {"mtbench": {"T1": cell(1.3, 0.8)}}}
    assert headline_of_evaluation(sampled_only) == {"speedup": 0.8}  # no T=0 run: no tau_t0 to show
