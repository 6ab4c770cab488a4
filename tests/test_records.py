"""Headline metrics beside the whole record: what DVC prints stays a screen wide, nothing is lost."""

from __future__ import annotations

import json

from specdistill.core.records import (
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
    assert read_record(tmp_path / "eagle.json") == record == read_records(tmp_path)["eagle"]
    (tmp_path / "old.json").write_text(json.dumps(record))  # written before the split: its own record
    assert read_record(tmp_path / "old.json") == record and set(read_records(tmp_path)) == {"eagle", "old"}


def test_training_and_serving_headlines():
    train = {"steps": 640, "final": {"val/alpha": 0.31234, "val/alpha_t0": 0.3, "val/tau_sim_t0": 1.48,
                                     "val/head1_top1": 0.2}}
    assert headline_of_training(train) == {"alpha": 0.3123, "alpha_t0": 0.3, "tau_sim_t0": 1.48}
    serve = {"chosen_k": {"c1": {"k": 1, "speedup_geomean": 1.01}, "c16": {"k": 1, "speedup_geomean": 0.57}},
             "deploy": {"speedup_geomean": {"c1": 0.95}}}
    assert headline_of_serving(serve) == {"c1": 0.95, "c16": 0.57}  # the deployed schedule's, else the best K's
