"""The evaluate stage on the tiny target: a random EAGLE-3 head and the stage's config for it, and the texts it
wrote."""

from __future__ import annotations

import json

import torch

from specdistill.methods.eagle.model import save_eagle

from .data import save_mtbench
from .drafts import random_head


def eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch, **eval_overrides) -> dict:
    """A random EAGLE-3 head for the tiny target in tmp_path/models/eagle, and the evaluate stage's config for it
    (one MT-bench conversation, T = 0 and 1), run from tmp_path."""
    from specdistill.core.models.target import TargetConfig, load_target
    save_mtbench(tmp_path / "prompts")
    loaded = load_target(TargetConfig(name_or_path=str(tiny_target_dir), dtype="float32"))
    head = random_head(loaded.model, "eagle3", torch.arange(100))
    head.cfg.target_fingerprint = loaded.fingerprint
    save_eagle(head, tmp_path / "models/eagle")
    monkeypatch.chdir(tmp_path)
    return {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
            "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
            "eval": {"method": "eagle", "datasets": ["mtbench"], "num_prompts": 1, "max_new_tokens": 8,
                     "temperatures": [0.0, 1.0], **eval_overrides},
            "decode": {"eagle": {"path": str(tmp_path / "models/eagle"),
                                 "tree": {"shape": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 5}},
                       "draft": {"path": None, "layers": 1}, "lookup": {"k": 4}}}


def greedy_texts(samples_file) -> dict:
    """(turn, method) -> the text each method wrote at T = 0."""
    samples = [json.loads(x) for x in samples_file.read_text().splitlines()]
    return {(s["turn"], s["method"]): s["text"] for s in samples if s["temperature"] == 0.0}
