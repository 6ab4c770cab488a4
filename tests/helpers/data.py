"""Splits on disk: generated token splits (what train reads), and prompt splits in the prompt contract."""

from __future__ import annotations

from pathlib import Path

import datasets
import torch


def write_split(folder, rows, seed, vocab, shard="shard-00000"):
    g = torch.Generator().manual_seed(seed)
    ids, plens = [], []
    for _ in range(rows):
        p, r = int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(4, 14, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (p + r,), generator=g).tolist())
        plens.append(p)
    datasets.Dataset.from_dict({"id": [f"{shard}-{i}" for i in range(rows)], "input_ids": ids, "prompt_len": plens}) \
        .save_to_disk(str(folder / shard))


def save_mtbench(prompts_dir: Path, turns: tuple[str, ...] = ("Write a poem.", "Shorter.")) -> None:
    """One MT-bench conversation in the prompt contract, saved where the evaluate stage reads it."""
    from specdistill.stages.prepare import save_split

    rows = [{"id": "0", "messages": [{"role": "user", "content": turns[0]}], "source": "mtbench", "category": "x",
             "reference": "", "turns": list(turns), "prompt": "", "prompt_tokens": 1}]
    save_split(rows, prompts_dir / "mtbench")


def save_questions(prompts_dir: Path, questions: list[str]) -> None:
    """One single-turn MT-bench conversation per question, in the prompt contract (eval.split=test takes the first
    num_prompts, dev the others: the eval.depth=auto pilot's)."""
    from specdistill.stages.prepare import save_split

    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": t}], "source": "mtbench", "category": "x",
             "reference": "", "turns": [t], "prompt": "", "prompt_tokens": 1} for i, t in enumerate(questions)]
    save_split(rows, prompts_dir / "mtbench")


def save_code_prompts(tok, folder, n=6):
    """`n` short code requests in the prompt contract (the online stage serves their `prompt` text)."""
    from specdistill.stages.prepare import save_split

    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"def f{i}(x):"}], "source": "humaneval",
             "category": "code", "reference": "", "turns": [f"def f{i}(x):"], "prompt_tokens": 1,
             "prompt": tok.apply_chat_template([{"role": "user", "content": f"def f{i}(x): return x + {i}"}],
                                               tokenize=False, add_generation_prompt=True)}
            for i in range(n)]
    save_split(rows, folder)
