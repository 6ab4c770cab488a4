"""What every benchmark shares: the project root on the path, and the pipeline's own target settings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def target_config(dtype: str, path: str | Path | None = None) -> dict[str, Any]:
    """The composed target of params.yaml (what `dvc repro` loads), at `dtype` and optionally another path:
    the benchmarks measure the pipeline's target, so they read its settings instead of a copy."""
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())["target"]
    return {**cfg, "name_or_path": str(path or ROOT / cfg["name_or_path"]), "dtype": dtype}


def engine_prompts(target: str | Path, n: int, prompts_dir: str | Path = ROOT / "data/prompts") -> list[list[int]]:
    """The first turns of n MT-bench conversations as the serve stage encodes them for the engine (`chat_encoder`
    with the exported target's tokenizer)."""
    from transformers import AutoTokenizer

    from specdistill.evaluation.prompts import chat_encoder, load_conversations

    encode = chat_encoder(AutoTokenizer.from_pretrained(target))
    return [encode([{"role": "user", "content": c.turns[0]}]) for c in load_conversations(prompts_dir, "mtbench", n)]


def mtbench_first_turns(tok: Any, n: int,
                        prompts_dir: str | Path = ROOT / "data/prompts") -> list[tuple[str, list[int]]]:
    """(id, chat-templated token ids) of the first turns of n MT-bench conversations (the prepare stage's split)."""
    from specdistill.evaluation.prompts import load_prompts

    out = []
    for conv in load_prompts(prompts_dir, "mtbench").select(range(n)):
        text = tok.apply_chat_template([{"role": "user", "content": conv["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        out.append((conv["id"], tok(text, add_special_tokens=False)["input_ids"]))
    return out
