"""Prompt sets for every stage: ShareGPT (train/val), MT-bench and HumanEval, or any `datasets` source.

Every split is a `datasets.Dataset` on disk with the contract columns `id`, `messages` (a list of
`{role, content}` ending in a user turn), `source`, `category`, plus `reference` (the dataset's own
answer to the last user turn, for the off-policy `dataset` source; empty for eval sets), `turns` (all
user turns; MT-bench's second turn follows the model's own first answer), and `prompt` /
`prompt_tokens` (the target's chat template applied, with the generation prompt).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

log = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one "
                         "Python code block.\n\n```python\n{prompt}```")


class PromptError(RuntimeError):
    """A prompt source is missing, malformed or filtered down to nothing."""


@dataclass
class SourceConfig:
    kind: str = "sharegpt_json"  # sharegpt_json (the pinned, truncated file) | datasets (any load_dataset source)
    path: str | None = None  # sharegpt_json: the JSON file
    name: str | None = None  # datasets: a hub id or a builder ("json", "parquet")
    config: str | None = None
    split: str = "train"
    data_files: Any = None
    format: str = "sharegpt"  # sharegpt ({from, value} turns) | messages ({role, content}) | prompt_response
    columns: dict[str, str] = field(default_factory=lambda: {"id": "id", "conversation": "conversations"})


@dataclass
class PrepareConfig:
    source: SourceConfig
    mtbench_path: str
    humaneval_path: str
    num_train: int = 2000
    num_val: int = 100
    num_mtbench: int = 80
    num_humaneval: int = 164
    val_fraction: float = 0.05
    max_turns: int = 2
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 512
    min_reference_chars: int = 1
    code_fraction: float | None = None  # train share whose dataset answer holds code (null: the source's own mix)
    train_offset: int = 0  # skip the first N of the train draw: prompts a draft trained on the first N has not seen
    seed: int = 0
    RANGES: ClassVar[dict[str, str]] = {  # checked by `section` at the stage's start, with the key named
        "num_train": "[1, inf)", "num_val": "[1, inf)", "num_mtbench": "[1, inf)", "num_humaneval": "[1, inf)",
        "val_fraction": "(0, 1)", "max_turns": "[1, inf)", "min_prompt_tokens": "[1, inf)",
        "max_prompt_tokens": "[1, inf)", "min_reference_chars": "[0, inf)", "train_offset": "[0, inf)"}

    def __post_init__(self) -> None:
        if self.code_fraction is not None and not 0.0 <= self.code_fraction <= 1.0:
            raise PromptError(f"data.code_fraction={self.code_fraction}: give a share in [0, 1], "
                              "or null for the source's own mix")
        if self.train_offset < 0:
            raise PromptError(f"data.train_offset={self.train_offset}: give the number of drawn train prompts to skip "
                              "(0 or more)")


# --- reading sources -----------------------------------------------------------------------------

@dataclass
class Recovery:
    records: list[dict[str, Any]]
    dropped_bytes: int
    dropped_records: int  # 1 if the file ends inside a record, else 0


def recover_json_array(text: str) -> Recovery:
    """Parse a JSON array record by record, keeping every complete record of a truncated file.

    A file cut off inside its last record is what an interrupted download leaves: the decoder runs out of text
    inside that record, and the complete records before it are kept. Anything else is an error naming the record
    and the byte: a record that fails to parse before the end of the text, a record boundary broken (`]` where
    `,` goes, text after the closing `]`), or a document that is not an array. Keeping what came before any of
    those would silently drop the rest of the file.
    """
    body = text.lstrip("\ufeff \t\r\n")
    if not body.startswith("["):
        what = f"it starts with {body[:1]!r}" + (" (a single object?)" if body.startswith("{") else "") if body \
            else "it is empty"
        raise PromptError(f"not a JSON array of conversations: {what}. ShareGPT files are one array of records")
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    records: list[dict[str, Any]] = []
    pos = len(text) - len(body) + 1

    def at(i: int) -> str:
        return f"byte {len(text[:i].encode())}"

    while True:
        pos = space.match(text, pos).end()
        if pos >= len(text):  # cut off between records: every record read is whole
            return Recovery(records, dropped_bytes=0, dropped_records=0)
        if text[pos] == "]":
            rest = space.match(text, pos + 1).end()
            if rest < len(text):
                raise PromptError(f"the array closes after record {len(records) - 1} ({at(pos)}) but the text goes on "
                                  f"({at(rest)}): the file is corrupt in the middle, not cut off at its end (a "
                                  f"damaged ',' between records?). Fetch it again or repair it there")
            return Recovery(records, dropped_bytes=0, dropped_records=0)
        if records:  # between two records: exactly one ','
            if text[pos] != ",":
                raise PromptError(f"after record {len(records) - 1}, {at(pos)} holds {text[pos]!r} where ',' or ']' "
                                  f"goes: the file is corrupt in the middle. Fetch it again or repair it there")
            pos = space.match(text, pos + 1).end()
            if pos >= len(text):
                return Recovery(records, dropped_bytes=0, dropped_records=0)
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if not _ran_out(text, err):
                raise PromptError(
                    f"record {len(records)} ({at(pos)}) is not valid JSON ({err.msg} at {at(err.pos)}) before the "
                    f"end of the file: the file is corrupt in the middle, not cut off at its end. Fetch it again or "
                    f"repair that record") from None
            return Recovery(records, dropped_bytes=len(text.encode()) - len(text[:pos].encode()), dropped_records=1)
        if not isinstance(obj, dict):
            raise PromptError(f"record {len(records)} ({at(pos)}) is a {type(obj).__name__}, not a conversation "
                              f"object: the file is not a ShareGPT array")
        records.append(obj)


def _ran_out(text: str, err: json.JSONDecodeError) -> bool:
    """Whether the decoder failed only because the text ended: at its last character, inside a string that never
    closes, or inside a literal (`tr` of `true`) that the end cut."""
    if not text[err.pos:].strip():
        return True
    if err.msg.startswith("Unterminated string"):
        return True
    word = text[err.pos:].rstrip()
    return any(lit.startswith(word) for lit in ("true", "false", "null"))


def _normalise(turns: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    """Map role names, drop empty turns, merge consecutive turns of one role, drop leading answers.

    ShareGPT V3 splits long conversations into chunks, so many start with an answer or carry an empty
    user turn; cleaned this way they still give well-formed user/assistant contexts.
    """
    out: list[dict[str, str]] = []
    for r, c in turns:
        if not isinstance(c, str) or not c.strip():
            continue
        role = ROLES.get(r, r)
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + c}
        elif out or role != "assistant":
            out.append({"role": role, "content": c})
    return out


def read_sharegpt_json(path: str | Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    path = Path(path)
    if not path.exists():
        raise PromptError(f"ShareGPT file {path} is missing: run the fetch_assets stage first")
    try:
        rec = recover_json_array(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise PromptError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}): convert it to UTF-8 "
                          "(e.g. `iconv -f latin1 -t utf-8`)") from None
    except PromptError as err:
        raise PromptError(f"{path}: {err}") from None
    if rec.dropped_records:
        log.warning("%s is cut off inside its last record: recovered %d complete conversations, dropped "
                    "%d partial record (%d bytes)", path.name, len(rec.records), rec.dropped_records, rec.dropped_bytes)
    if not rec.records:
        raise PromptError(f"{path} holds no complete conversation")
    for r in rec.records:
        yield str(r.get("id")), _normalise((t.get("from", ""), t.get("value")) for t in r.get("conversations", []))


def read_datasets_source(src: SourceConfig) -> Iterator[tuple[str, list[dict[str, str]]]]:
    import datasets

    if not src.name:
        raise PromptError("data.source.kind=datasets needs data.source.name (a hub id or 'json', 'parquet', ...)")
    ds = datasets.load_dataset(src.name, src.config, split=src.split, data_files=src.data_files)
    if src.format not in ("sharegpt", "messages", "prompt_response"):
        raise PromptError(f"data.source.format={src.format!r}: use sharegpt, messages or prompt_response")
    cols = dict(src.columns)
    for i, row in enumerate(ds):
        try:
            turns = _row_turns(row, src.format, cols)
        except (KeyError, TypeError, AttributeError) as err:
            raise PromptError(
                f"row {i} of data.source.name={src.name} does not have the {src.format!r} shape ({type(err).__name__}: "
                f"{err}); its columns are {sorted(row)}. Set data.source.format and data.source.columns to match "
                "(sharegpt: turns of {from, value}; messages: turns of {role, content}; prompt_response: two "
                "text columns)") from None
        yield (str(row[cols["id"]]) if cols.get("id") in row else f"{src.name}-{i}"), turns


def _row_turns(row: dict[str, Any], fmt: str, cols: dict[str, str]) -> list[dict[str, str]]:
    if fmt == "sharegpt":
        return _normalise((t.get("from", ""), t.get("value")) for t in row[cols.get("conversation", "conversations")])
    if fmt == "messages":
        return _normalise((t["role"], t["content"]) for t in row[cols.get("conversation", "messages")])
    return _normalise([("user", row[cols.get("prompt", "prompt")]),
                       ("assistant", row.get(cols.get("response", "response"), ""))])


# --- contexts ------------------------------------------------------------------------------------

def contexts(conv_id: str, turns: list[dict[str, str]], max_turns: int) -> Iterator[dict[str, Any]]:
    """Contexts that end in a user turn: the first 1..max_turns user turns, with the answer that followed."""
    system = [t for t in turns[:1] if t["role"] == "system"]
    body = turns[len(system):]
    n_user = 0
    for i, t in enumerate(body):
        if t["role"] != "user" or not t["content"].strip():
            continue
        # a well-formed context alternates user/assistant up to this turn
        if any(body[j]["role"] != ("user" if j % 2 == 0 else "assistant") for j in range(i + 1)):
            return
        n_user += 1
        nxt = body[i + 1]["content"] if i + 1 < len(body) and body[i + 1]["role"] == "assistant" else ""
        yield {"id": f"{conv_id}#{n_user}", "conv_id": conv_id, "messages": system + body[: i + 1],
               "reference": nxt, "turns": [b["content"] for b in body[: i + 1] if b["role"] == "user"]}
        if n_user >= max_turns:
            return


# Markers of code in an answer: a fence, or a line that starts a definition, an import or a query, each in a
# form prose does not take ("from France we went", "class struggle", "the function f(x)" do not match). Used to
# weight the training mix towards code (HumanEval-like targets); ShareGPT has no domain labels of its own.
CODE_MARKERS = re.compile(
    r"```|^\s*def \w+\s*\(|^\s*class \w+\s*[:({]|^\s*import [\w.]+\s*(?:$|;| as )|^\s*import .+ from ['\"]|"
    r"^\s*from [\w.]+ import\b|"
    r"#include\s*<|\bfunction\s*\w*\s*\([^)]*\)\s*\{|\bpublic (?:static )?(?:class|void)\b|console\.log\(|"
    r"^\s*SELECT\b[^;]{0,300}?\bFROM\b", re.M)


def looks_like_code(text: str) -> bool:
    return CODE_MARKERS.search(text) is not None


def _hash01(key: str) -> float:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def _dedup_key(messages: list[dict[str, str]]) -> str:
    text = "\x00".join(re.sub(r"\s+", " ", m["content"].strip().lower()) for m in messages)
    return hashlib.sha1(text.encode()).hexdigest()


def apply_template(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, int]:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt, len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def build_train_val(pairs: Iterable[tuple[str, list[dict[str, str]]]], cfg: PrepareConfig, tokenizer: Any,
                    source_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    stats = {"conversations": 0, "contexts": 0, "duplicates": 0, "too_short": 0, "too_long": 0, "no_reference": 0}
    seen: set[str] = set()
    kept: list[dict[str, Any]] = []
    max_chars = cfg.max_prompt_tokens * 12  # cheap pre-filter before tokenising: ~4 chars a token
    for conv_id, turns in pairs:
        stats["conversations"] += 1
        for ctx in contexts(conv_id, turns, cfg.max_turns):
            stats["contexts"] += 1
            key = _dedup_key(ctx["messages"])
            if key in seen:
                stats["duplicates"] += 1
                continue
            seen.add(key)
            if len(ctx["reference"]) < cfg.min_reference_chars:
                stats["no_reference"] += 1
                continue
            if sum(len(m["content"]) for m in ctx["messages"]) > max_chars:
                stats["too_long"] += 1
                continue
            kept.append(ctx)
    train, val = [], []
    for ctx in kept:
        prompt, n = apply_template(tokenizer, ctx["messages"])
        if n < cfg.min_prompt_tokens:
            stats["too_short"] += 1
            continue
        if n > cfg.max_prompt_tokens:
            stats["too_long"] += 1
            continue
        row = {"id": ctx["id"], "messages": ctx["messages"], "source": source_name,
               "category": "multi_turn" if len(ctx["turns"]) > 1 else "single_turn",
               "reference": ctx["reference"], "turns": ctx["turns"], "prompt": prompt, "prompt_tokens": n}
        # split by conversation, so no conversation feeds both train and val
        (val if _hash01(f"split:{ctx['conv_id']}") < cfg.val_fraction else train).append(row)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(train))  # drawn either way: val's draw must not depend on code_fraction
    if cfg.train_offset and cfg.train_offset >= len(train):
        raise PromptError(f"data.train_offset={cfg.train_offset} skips all {len(train)} train prompts the source "
                          "gives after filtering; lower it")
    if cfg.code_fraction is None:
        train = [train[i] for i in order[cfg.train_offset: cfg.train_offset + cfg.num_train]]
    else:  # the mix draws from what the natural draw's first train_offset prompts leave, in the source's order
        seen = set(order[: cfg.train_offset].tolist())
        train = code_mix([r for i, r in enumerate(train) if i not in seen], cfg.num_train, cfg.code_fraction,
                         np.random.default_rng([cfg.seed, 1]))
    val = _draw(val, cfg.num_val, rng)  # val keeps the source's mix: comparable
    if not train or not val:
        raise PromptError(f"no prompts left for {'train' if not train else 'val'} after filtering ({stats}); "
                          "relax data.min_prompt_tokens / max_prompt_tokens or raise data.val_fraction")
    if len(train) < cfg.num_train or len(val) < cfg.num_val:
        log.warning("asked for %d train / %d val prompts, the source gives %d / %d", cfg.num_train, cfg.num_val,
                    len(train), len(val))
    return train, val, stats


def _draw(rows: list[dict[str, Any]], k: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """k rows without replacement, in random order (all of them when k >= len(rows))."""
    return [rows[i] for i in rng.permutation(len(rows))[:k]]


def code_mix(rows: list[dict[str, Any]], n: int, fraction: float, rng: np.random.Generator) -> list[dict[str, Any]]:
    """`n` rows, round(n * fraction) of them with code in their dataset answer, in random order.

    The answer is the source's (`reference`), not the target's, which does not exist yet: the prompt is
    what is chosen here, and a prompt whose answer held code asks for code.
    """
    is_code = [looks_like_code(r["reference"]) for r in rows]
    code = [r for r, c in zip(rows, is_code, strict=True) if c]
    chat = [r for r, c in zip(rows, is_code, strict=True) if not c]
    n = min(n, len(rows))
    want = round(n * fraction)
    if want > len(code) or n - want > len(chat):
        raise PromptError(f"data.code_fraction={fraction} of {n} train prompts needs {want} with code and "
                          f"{n - want} without; the source has {len(code)} and {len(chat)} after filtering. "
                          "Lower data.num_train, or move data.code_fraction towards the source's own share "
                          f"({len(code) / max(len(rows), 1):.2f})")
    picked = _draw(code, want, rng) + _draw(chat, n - want, rng)
    return _draw(picked, len(picked), rng)


def mix_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    code = sum(looks_like_code(r["reference"]) for r in rows)
    return {"prompts": len(rows), "code": code, "code_share": round(code / max(len(rows), 1), 4)}


def mtbench_rows(path: str | Path, tokenizer: Any, limit: int) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise PromptError(f"MT-bench questions {path} are missing: run the fetch_assets stage first")
    rows = []
    for number, line in enumerate(_lines(path)[:limit], 1):
        try:
            q = json.loads(line)
            q["turns"][0], q["question_id"], q["category"]  # noqa: B018 (the fields every row needs)
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise PromptError(f"{path} line {number} is not an MT-bench question ({type(err).__name__}: {err}); "
                              "each line is a JSON object with question_id, category and turns. Fetch the file "
                              "again (`dvc repro -f fetch_assets`) or mend that line") from None
        messages = [{"role": "user", "content": q["turns"][0]}]
        prompt, n = apply_template(tokenizer, messages)
        rows.append({"id": str(q["question_id"]), "messages": messages, "source": "mtbench",
                     "category": q["category"], "reference": "", "turns": list(q["turns"]),
                     "prompt": prompt, "prompt_tokens": n})
    return rows


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise PromptError(f"{path} is not UTF-8 text (byte {err.start}): fetch it again or convert it") from None


def humaneval_rows(path: str | Path, tokenizer: Any, limit: int) -> list[dict[str, Any]]:
    import gzip

    path = Path(path)
    if not path.exists():
        raise PromptError(f"HumanEval problems {path} are missing: run the fetch_assets stage first")
    rows = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = list(f)
    except (OSError, EOFError, UnicodeDecodeError) as err:  # gzip.BadGzipFile is an OSError
        raise PromptError(f"{path} is not a gzip-compressed JSONL file ({type(err).__name__}: {err}): fetch it "
                          "again (`dvc repro -f fetch_assets`)") from None
    for number, line in enumerate(lines[:limit], 1):
        try:
            p = json.loads(line)
            p["task_id"], p["prompt"]  # noqa: B018
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise PromptError(f"{path} line {number} is not a HumanEval problem ({type(err).__name__}: {err}); "
                              "each line is a JSON object with task_id and prompt") from None
        content = HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])
        messages = [{"role": "user", "content": content}]
        prompt, n = apply_template(tokenizer, messages)
        rows.append({"id": p["task_id"], "messages": messages, "source": "humaneval", "category": "code",
                     "reference": p.get("canonical_solution", ""), "turns": [content],
                     "prompt": prompt, "prompt_tokens": n})
    return rows
