"""On-policy training data: the target answers the prompts, batched and KV-cached, in resumable shards.

Why not `model.generate`: on the CPU its decode loop spends most of a step outside the matmuls
(a full-vocabulary sort for top-p, `torch.multinomial`, `torch.cat` of the KV cache per layer, and
rows that finished long ago still being computed). This loop sorts prompts by length so batches carry
little padding, writes keys and values into a preallocated cache, samples with a top-k-bounded
nucleus and the exponential race, and drops finished rows from the batch as it goes.

Output contract (docs/definitions.md): `<out>/<split>/shard-NNNNN/` as `datasets` Arrow with `id`, `input_ids`
(prompt + response, unpadded), `prompt_len`, and optionally `topk_ids` / `topk_logprobs` of the target
(temperature 1, before any warping) for each response position; `<out>/manifest.json`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdistill.core.io import config_hash, has_stamp, remove_stale_temporaries, save_dataset
from specdistill.core.models.kv_cache import PreallocatedCache
from specdistill.core.models.target import stop_ids
from specdistill.core.outputs import check_replaceable
from specdistill.core.sampling import sample_logits

log = logging.getLogger(__name__)

SOURCES = ("target", "dataset")
ENGINES = ("own", "vllm")


class GenerationError(RuntimeError):
    """Generation cannot run as configured."""


@dataclass
class GenerateConfig:
    source: str = "target"  # target: on-policy answers of the target | dataset: the dataset's own answers
    splits: list[str] = field(default_factory=lambda: ["train", "val"])
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 256
    batch_size: int = 32
    shard_size: int = 256  # prompts per shard: the unit of resumption
    topk_logprobs: int = 0  # store the target's top-k logprobs per response position (0: off)
    compact_below: float = 0.75  # drop finished rows once fewer than this fraction of the batch is alive
    seed: int = 0
    engine: str = "own"  # own: this package's batched loop | vllm: the serving engine (engine/generation.py)
    engine_workers: int = 1  # engine processes side by side, each on its own shards (data parallel)
    engine_tp: int = 1  # GPUs per engine process (tensor parallel; engine_device=cuda)
    engine_device: str = "cpu"  # cpu: the workers split the cores | cuda: worker w takes GPUs [w*tp, (w+1)*tp)
    engine_timeout_s: int = 86400
    RANGES: ClassVar[dict[str, str]] = {  # checked by `section` at the stage's start, with the key named
        "temperature": "[0, 2]", "top_p": "(0, 1]", "top_k": "[0, inf)", "max_new_tokens": "[1, inf)",
        "batch_size": "[1, inf)", "shard_size": "[1, inf)", "topk_logprobs": "[0, inf)", "compact_below": "[0, 1]",
        "engine_workers": "[1, inf)", "engine_tp": "[1, inf)", "engine_timeout_s": "[1, inf)"}
    # how the answers are computed, not what they are: kept out of the data's fingerprint (the engine's name and
    # version go in instead, from the stage)
    HOW: ClassVar[tuple[str, ...]] = ("splits", "engine", "engine_workers", "engine_tp", "engine_device",
                                      "engine_timeout_s")

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise GenerationError(f"generate.source={self.source!r}: use one of {SOURCES}")
        if self.engine not in ENGINES:
            raise GenerationError(f"generate.engine={self.engine!r}: use one of {ENGINES}")
        if self.engine == "vllm" and self.source != "target":
            raise GenerationError("generate.engine=vllm answers with the target: it needs generate.source=target "
                                  "(the dataset's own answers need no engine)")
        if self.engine_device not in ("cpu", "cuda"):
            raise GenerationError(f"generate.engine_device={self.engine_device!r}: use cpu or cuda")
        if self.engine_tp > 1 and self.engine_device != "cuda":
            raise GenerationError(f"generate.engine_tp={self.engine_tp} splits a target over GPUs: it needs "
                                  "generate.engine_device=cuda (on a CPU use engine_workers)")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shard_size < 1:
            raise GenerationError("generate.max_new_tokens, batch_size and shard_size must be >= 1")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"generate.top_p={self.top_p} must be in (0, 1]")

    def fingerprint(self, extra: dict[str, Any]) -> str:
        """What decides a shard's content; a shard written under another fingerprint is stale."""
        keep = {k: v for k, v in asdict(self).items() if k not in self.HOW}
        return config_hash({**keep, **extra})


@dataclass
class BatchResult:
    responses: list[list[int]]
    topk_ids: list[list[list[int]]] | None = None
    topk_logprobs: list[list[list[float]]] | None = None


def last_logits(model: Any, **kwargs: Any) -> torch.Tensor:
    """Logits [B, V] (float32) at the last position, through the decoder and the LM head.

    Not `logits_to_keep=1`: it hands the LM head a strided [B, 1, H] slice, for which `F.linear` on
    the CPU materialises the head weight once per row (a 3.6 GB copy for 64 prompts of SmolLM2).
    """
    hidden = model.get_decoder()(**kwargs).last_hidden_state
    return model.get_output_embeddings()(hidden[:, -1].contiguous()).float()


@torch.inference_mode()
def generate_batch(model: Any, prompts: list[list[int]], cfg: GenerateConfig, stops: set[int], pad_id: int,
                   generator: torch.Generator | None) -> BatchResult:
    """Answer a batch of tokenised prompts; left padding, one preallocated KV cache for the batch."""
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + cfg.max_new_tokens
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, total), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):width] = 1
    ids, mask = ids.to(device), mask.to(device)
    position = (mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
    cache = PreallocatedCache(model.config.num_hidden_layers, total)
    logits = last_logits(model, input_ids=ids, attention_mask=mask[:, :width], position_ids=position,
                         cache=cache, use_cache=True)
    next_pos = position[:, -1:] + 1
    rows = torch.arange(b)  # batch row -> prompt index
    responses: list[list[int]] = [[] for _ in range(b)]
    want_topk = cfg.topk_logprobs > 0
    tk_ids: list[list[list[int]]] = [[] for _ in range(b)]
    tk_lp: list[list[list[float]]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    stop_t = torch.tensor(sorted(stops))
    for step in range(cfg.max_new_tokens):
        tok = sample_logits(logits, cfg.temperature, cfg.top_p, cfg.top_k, generator).cpu()
        if want_topk:
            lp, li = torch.log_softmax(logits, -1).topk(cfg.topk_logprobs, -1)
            lp, li = lp.cpu().tolist(), li.cpu().tolist()
        live = (~done[rows]).nonzero().flatten().tolist()
        tok_list = tok.tolist()
        for j in live:
            r = int(rows[j])
            responses[r].append(tok_list[j])
            if want_topk:
                tk_ids[r].append(li[j])
                tk_lp[r].append(lp[j])
        done[rows] |= torch.isin(tok, stop_t)
        alive = ~done[rows]
        if not bool(alive.any()) or step == cfg.max_new_tokens - 1:
            break
        if float(alive.float().mean()) < cfg.compact_below:
            keep = alive.nonzero().flatten()
            keep_dev = keep.to(device)
            cache.batch_select_indices(keep_dev)
            rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep_dev], next_pos[keep_dev]
        cur = width + step + 1
        mask[:, cur - 1] = 1
        logits = last_logits(model, input_ids=tok.to(device)[:, None], attention_mask=mask[:, :cur],
                             position_ids=next_pos, cache=cache, use_cache=True)
        next_pos = next_pos + 1
    if want_topk:
        return BatchResult(responses, tk_ids, tk_lp)
    return BatchResult(responses)


def pad_rows(model: Any, sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, T] of right-padded fixed sequences, on the model's device."""
    device = next(model.parameters()).device
    ids = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def score_topk(model: Any, sequences: list[list[int]], prompt_lens: list[int], k: int,
               pad_id: int) -> tuple[list[list[list[int]]], list[list[list[float]]]]:
    """The target's top-k logprobs at every response position of fixed sequences (prefill only)."""
    ids, mask = pad_rows(model, sequences, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp, li = torch.log_softmax(logits, -1).topk(k, -1)
    out_ids, out_lp = [], []
    for i, (s, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        # position t predicts token t+1: the response tokens s[p:] are predicted at p-1 .. len-2
        out_ids.append(li[i, p - 1: len(s) - 1].tolist())
        out_lp.append(lp[i, p - 1: len(s) - 1].tolist())
    return out_ids, out_lp


def dataset_responses(tokenizer: Any, references: list[str], max_new_tokens: int) -> list[list[int]]:
    """The dataset's own answers, tokenised as the target would have emitted them (ending in eos)."""
    eos = tokenizer.eos_token or ""
    out = []
    for ref in references:
        ids = tokenizer(ref + eos, add_special_tokens=False)["input_ids"]
        out.append(ids[:max_new_tokens])
    return out


def _batches(order: list[int], size: int) -> Iterator[list[int]]:
    for i in range(0, len(order), size):
        yield order[i:i + size]


def generate_shard(model: Any, tokenizer: Any, rows: list[dict[str, Any]], cfg: GenerateConfig, shard_seed: int,
                   on_tokens: Callable[[int, int], None] | None = None) -> dict[str, list[Any]]:
    """Generate one shard's columns. Prompts run sorted by length; output keeps the input order."""
    stops = stop_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    prompts = tokenise_prompts(tokenizer, rows)
    responses: list[list[int]] = [[] for _ in rows]
    topk_ids: list[Any] = [None] * len(rows)
    topk_lp: list[Any] = [None] * len(rows)
    generator = torch.Generator().manual_seed(shard_seed)
    order = sorted(range(len(rows)), key=lambda i: (len(prompts[i]), i))
    for batch in _batches(order, cfg.batch_size):
        if cfg.source == "target":
            res = generate_batch(model, [prompts[i] for i in batch], cfg, stops, pad_id, generator)
        else:
            res = BatchResult(dataset_responses(tokenizer, [rows[i]["reference"] for i in batch], cfg.max_new_tokens))
            if cfg.topk_logprobs > 0:
                seqs = [prompts[i] + r for i, r in zip(batch, res.responses, strict=True)]
                res.topk_ids, res.topk_logprobs = score_topk(model, seqs, [len(prompts[i]) for i in batch],
                                                             cfg.topk_logprobs, pad_id)
        for j, i in enumerate(batch):
            responses[i] = res.responses[j]
            if res.topk_ids is not None:
                topk_ids[i], topk_lp[i] = res.topk_ids[j], res.topk_logprobs[j]
        if on_tokens:
            on_tokens(len(batch), sum(len(r) for r in res.responses))
    return shard_columns(rows, prompts, responses, (topk_ids, topk_lp) if cfg.topk_logprobs > 0 else None)


def tokenise_prompts(tokenizer: Any, rows: list[dict[str, Any]]) -> list[list[int]]:
    """The prompts' token ids as every generation path feeds them (the chat template is already in the text)."""
    return [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]


def shard_columns(rows: list[dict[str, Any]], prompts: list[list[int]], responses: list[list[int]],
                  topk: tuple[list[Any], list[Any]] | None = None) -> dict[str, list[Any]]:
    """A shard's columns (the output contract): id, input_ids (prompt + response), prompt_len, and top-k."""
    cols: dict[str, list[Any]] = {
        "id": [r["id"] for r in rows],
        "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
        "prompt_len": [len(p) for p in prompts],
    }
    if topk is not None:
        cols["topk_ids"], cols["topk_logprobs"] = topk
    return cols


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def prepare_output(out_dir: Path, fingerprint: str) -> None:
    """Keep shards written under the same fingerprint (resume); wipe them if the config changed."""
    if (out_dir.exists() or out_dir.is_symlink()) and not has_stamp(out_dir, fingerprint):
        # only a folder this stage wrote (its FINGERPRINT) is wiped; any other is refused, never deleted
        check_replaceable(out_dir, "paths.generated_dir", markers=("FINGERPRINT",))
        if any(out_dir.iterdir()):
            log.warning("%s holds shards of another configuration: regenerating from scratch", out_dir)
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "FINGERPRINT").write_text(fingerprint + "\n")
    for split_dir in [p for p in out_dir.iterdir() if p.is_dir()]:
        removed = remove_stale_temporaries(split_dir)
        if removed:
            log.info("removed %d half-written shard(s) in %s", removed, split_dir)


LEGACY_SHARD_STATS = "generation.json"  # timing kept inside a shard before it moved to metrics/generate.json


def write_shard(cols: dict[str, list[Any]], final: Path) -> None:
    """Write a shard: its files depend on its rows alone, so identical data keeps its DVC hash on a rerun."""
    import datasets

    save_dataset(datasets.Dataset.from_dict(cols), final)


def pop_legacy_stats(shard: Path) -> dict[str, Any] | None:
    """Timing that an older run wrote inside a shard: read, then removed, so the shard hashes by content."""
    path = shard / LEGACY_SHARD_STATS
    if not path.exists():
        return None
    stats = json.loads(path.read_text())
    path.unlink()
    return stats


def count_tokens(shard: Path) -> tuple[int, int, int]:
    """(sequences, prompt tokens, response tokens) of a written shard."""
    import datasets

    ds = datasets.load_from_disk(str(shard))
    lens = [len(x) for x in ds["input_ids"]]
    plen = list(ds["prompt_len"])
    return len(lens), sum(plen), sum(lens) - sum(plen)
