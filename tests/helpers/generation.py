"""The generate stage on the tiny target: its prompt splits, its config, and its shards read back."""

from __future__ import annotations

from pathlib import Path

import datasets

from specdistill.core.data.prompts import apply_template
from specdistill.stages.prepare import save_split

QUESTIONS = ["Write a poem about the sea.", "What is the capital of France?", "def add(a, b):",
             "Explain speculative decoding.", "The quick brown fox", "Write a poem about the sky and the sea.",
             "What is", "Explain the lazy dog to a child in three sentences please."]


def make_prompts(tok, folder: Path, n_train: int = 20, n_val: int = 6) -> None:
    def rows(n, tag):
        out = []
        for i in range(n):
            msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({tag} {i})"}]
            prompt, n_tok = apply_template(tok, msgs)
            out.append({"id": f"{tag}-{i}", "messages": msgs, "source": "test", "category": "single_turn",
                        "reference": "Paris is the capital of France.", "turns": [msgs[0]["content"]],
                        "prompt": prompt, "prompt_tokens": n_tok})
        return out

    save_split(rows(n_train, "train"), folder / "train")
    save_split(rows(n_val, "val"), folder / "val")


def stage_cfg(target_dir: Path, tmp: Path, **gen) -> dict:
    g = {"source": "target", "splits": ["train", "val"], "temperature": 1.0, "top_p": 0.9, "top_k": 0,
         "max_new_tokens": 12, "batch_size": 4, "shard_size": 5, "topk_logprobs": 0, "compact_below": 0.75,
         "seed": 7}
    g.update(gen)
    return {"experiment_name": "test", "seed": 7,
            "paths": {"prompts_dir": str(tmp / "prompts"), "generated_dir": str(tmp / "generated"),
                      "metrics_dir": str(tmp / "metrics")},
            "target": {"name_or_path": str(target_dir), "gguf_file": None, "revision": None, "dtype": "float32",
                       "device": "cpu", "trust_remote_code": False, "attn_implementation": "sdpa",
                       "num_threads": None},
            "generate": g, "logger": {"enabled": False}}


def read_split(folder: Path) -> datasets.Dataset:
    shards = sorted(folder.glob("shard-*"))
    return datasets.concatenate_datasets([datasets.load_from_disk(str(s)) for s in shards])
