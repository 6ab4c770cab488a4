"""The evaluation prompts: a prompt split the prepare stage wrote, MT-bench and HumanEval conversations in a
stratified order (test and a disjoint dev split), and the chat encoding the target continues. Shared by the
evaluate and serve stages and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.core.errors import ConfigError

SPLITS = ("test", "dev")
# the prompt sets prepare writes that a draft is measured on: the two benchmarks, and `val`, the held-out prompts of
# the training source (your own domain when `data=` is yours). `train` holds what the drafts were distilled on
BENCHMARKS = ("mtbench", "humaneval")
HELD_OUT = "val"
TRAINED_ON = "train"


def check_eval_sets(names: list[str], key: str) -> None:
    """A list of prompt sets to measure on, checked before anything loads: at least one, each once, none the drafts
    were trained on. Whether each exists is the prompts' load's to say (it lists the sets prepare wrote)."""
    if not names:
        raise ConfigError(f"{key}=[]: name at least one prompt set ({', '.join((*BENCHMARKS, HELD_OUT))})")
    if TRAINED_ON in names:
        raise ConfigError(f"{key}={list(names)}: '{TRAINED_ON}' holds the prompts the drafts were distilled on, where "
                          f"their acceptance overstates what they meet in service; use '{HELD_OUT}', the held-out "
                          "prompts of the same source")
    if len(set(names)) < len(names):
        raise ConfigError(f"{key}={list(names)} names a set twice: list each once")


@dataclass
class Conversation:
    id: str
    turns: list[str]


def load_prompts(prompts_dir: str | Path, split: str) -> Any:
    """A prompt split the prepare stage wrote (a `datasets.Dataset`); a clear error when it has not run."""
    import datasets

    path = Path(prompts_dir) / split
    if not path.is_dir():
        there = sorted(p.name for p in Path(prompts_dir).glob("*") if p.is_dir() and p.name != TRAINED_ON)
        own = split not in (*BENCHMARKS, HELD_OUT, TRAINED_ON)  # not a set prepare writes: a name to correct
        raise FileNotFoundError(f"prompt split {path} is missing: " + (
            f"{prompts_dir} holds {', '.join(there)}; name one of those" if there and own
            else "run the prepare stage first (`dvc repro prepare`)"))
    return datasets.load_from_disk(str(path))


def stratified_order(categories: list[str], from_end: bool = False) -> list[int]:
    """Row indices taking each category in turn (categories by first appearance, rows in set order, or from
    each category's last row with `from_end`): MT-bench is stored by category, ten questions each, so its
    first rows would all be writing prompts."""
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        by_cat.setdefault(c, []).append(i)
    queues = [q[::-1] if from_end else q for q in by_cat.values()]
    return [q[r] for r in range(max(map(len, queues), default=0)) for q in queues if r < len(q)]


def one_per_conversation(ids: list[str], n_turns: list[int]) -> list[int]:
    """Row indices with one context per conversation, its longest: prepare writes a conversation's first k user
    turns as rows `<conv>#1..#k` (val), whose first turns are the same prompt; measured twice, it would count twice
    (and the engine would serve it from its prefix cache). Sets without such ids (the benchmarks) keep every row."""
    best: dict[str, int] = {}
    for i, rid in enumerate(ids):
        conv = rid.rsplit("#", 1)[0] if "#" in rid else rid
        if conv not in best or n_turns[i] > n_turns[best[conv]]:
            best[conv] = i
    return sorted(best.values())


def load_conversations(prompts_dir: Path, name: str, n: int, split: str = "test",
                       test_n: int | None = None) -> list[Conversation]:
    """n conversations of set `name`, its categories in turn: the first n rows of each category (test), or
    the last n (dev: the same mix of categories, other prompts). Dev must not reach the `test_n` (default n)
    test prompts that are reported: settings tuned on them would overstate the result."""
    ds = load_prompts(prompts_dir, name)
    kept = one_per_conversation(list(ds["id"]), [len(t) for t in ds["turns"]])
    column = ds["category"]  # one read of the column, not one per row
    categories = [column[i] for i in kept]
    order = [kept[i] for i in stratified_order(categories)]
    if split == "test":
        rows = order[:n]
    elif split == "dev":
        rows = [kept[i] for i in stratified_order(categories, from_end=True)][:n]
        reported = order[:n if test_n is None else test_n]
        if set(rows) & set(reported):
            raise ConfigError(f"dev split: {n} dev prompts of {name} ({len(kept)} rows) would overlap its "
                              f"{len(reported)} test prompts; lower the dev count (eval.num_prompts, or the "
                              "benchmark's --prompts) so that dev + test fit in the set")
    else:
        raise ConfigError(f"split={split!r}: use one of {SPLITS}")
    return [Conversation(r["id"], list(r["turns"])) for r in ds.select(rows)]


def chat_encoder(tok: Any) -> Callable[[list[dict[str, str]]], list[int]]:
    """messages -> the token ids the target continues (its chat template, with the assistant's turn opened)."""
    def encode(messages: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    return encode
