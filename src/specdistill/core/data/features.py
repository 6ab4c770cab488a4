"""Precomputed target features for EAGLE training: one frozen-target pass per sequence, kept on disk,
instead of one pass per sequence per epoch (and per run of a sweep).

The `features` stage writes, beside each generate-stage shard, `<features_dir>/<split>/shard-XXXXX.safetensors`:

- `features` [sum(p'+r'), F]: the HiddenTap states of `layers` side by side (F = H * len(layers)) at every
  kept position of each row, in `features.dtype` (auto: the target's compute dtype, as the live path feeds them);
- `topk_ids` [sum(r'), k] int32 / `topk_logprobs` [sum(r'), k] float32: the target's top-k log-probs at
  temperature 1 for each kept response token (row j: the distribution of response token j);
- `prompt_kept`, `response_kept` [n] int64 and the row ids (metadata): p', r' are the spans the train
  stage keeps under `distill.data.max_length` (`truncated_lengths`), so a stored row is exactly what the
  live path would have run the target on.

`features_dir/manifest.json` records the fingerprint (the generated data's, the target's, max_length,
layers, k, dtype, and the engine's name and version when `features.engine=vllm` computed it); the train stage
refuses a store whose fingerprint does not fit its own config. Both engines write the same shard format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from specdistill.core.errors import DataError
from specdistill.core.io import atomic_path, config_hash

MANIFEST = "manifest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class FeaturesConfig:
    layers: list[int] | None = None  # HiddenTap indices; null: what eagle and eagle1 read by default
    topk: int = 128  # the target's top-k log-probs per response token: the stored teacher
    dtype: str = "auto"  # the stored features; auto: the target's dtype, as the live path and inference feed them
    batch_size: int = 8
    splits: list[str] = field(default_factory=lambda: ["train"])  # []: nothing (an experiment whose EAGLE runs live)
    engine: str = "own"  # own: this package's pass | vllm: the serving engine (engine/features.py)
    engine_workers: int = 1  # engine processes side by side, each on its own shards
    engine_device: str = "cpu"  # cpu: the workers split the cores | cuda: worker w takes GPU w
    engine_timeout_s: int = 86400
    RANGES: ClassVar[dict[str, str]] = {"layers": "[0, inf)", "topk": "[1, inf)", "batch_size": "[1, inf)",
                                        "engine_workers": "[1, inf)", "engine_timeout_s": "[1, inf)"}

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"features.dtype={self.dtype!r}: use auto (the target's) or one of {sorted(DTYPES)}")
        if self.topk < 1 or self.batch_size < 1:
            raise ValueError(f"features.topk={self.topk} and features.batch_size={self.batch_size} must be >= 1")
        if self.engine not in ("own", "vllm"):
            raise ValueError(f"features.engine={self.engine!r}: use own or vllm")
        if self.engine_device not in ("cpu", "cuda"):
            raise ValueError(f"features.engine_device={self.engine_device!r}: use cpu or cuda")
        if self.engine_workers < 1:
            raise ValueError(f"features.engine_workers={self.engine_workers} must be >= 1")


def store_fingerprint(layers: list[int], topk: int, dtype: str, max_length: int, target: str, generated: str,
                      engine: str | None = None) -> str:
    """What decides a store's content: a store of another fingerprint is recomputed whole (`prepare_output`).
    `engine` (its name and version, features.engine=vllm) enters only when set: the own pass's stores keep theirs."""
    return config_hash({"layers": list(layers), "topk": topk, "dtype": dtype, "max_length": max_length,
                        "target": target, "generated": generated, **({"engine": engine} if engine else {})})


@torch.inference_mode()
def compute_features(model: Any, rows: list[tuple[list[int], int, int]], layers: list[int], topk: int,
                     dtype: torch.dtype, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(features [p+r, F], topk_ids [r, k], topk_logprobs [r, k]) of rows (kept span, p, r), one padded batch."""
    from specdistill.core.data.generation import pad_rows
    from specdistill.core.models.hidden import HiddenTap

    ids, mask = pad_rows(model, [s for s, _, _ in rows], pad_id)
    with HiddenTap(model, layers) as tap:  # the same call as the live path (methods/eagle/training.py)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    feats = tap.concat()
    out = []
    for i, (_, p, r) in enumerate(rows):
        # position t predicts token t+1: response tokens p..p+r-1 are predicted at p-1..p+r-2
        logits = model.get_output_embeddings()(hidden[i, p - 1:p + r - 1]).float()
        lp, li = torch.log_softmax(logits, -1).topk(min(topk, logits.shape[-1]), -1)
        out.append((feats[i, :p + r].to(dtype).cpu(), li.to(torch.int32).cpu(), lp.cpu()))
    return out


def write_shard(final: Path, ids: list[str], prompt_kept: list[int], response_kept: list[int],
                parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """One store shard, atomically (a killed stage leaves no half-written shard under its final name)."""
    from safetensors.torch import save_file

    tensors = {"features": torch.cat([f for f, _, _ in parts]).contiguous(),
               "topk_ids": torch.cat([i for _, i, _ in parts]).contiguous(),
               "topk_logprobs": torch.cat([lp for _, _, lp in parts]).contiguous(),
               "prompt_kept": torch.tensor(prompt_kept, dtype=torch.int64),
               "response_kept": torch.tensor(response_kept, dtype=torch.int64)}
    with atomic_path(final) as tmp:
        save_file(tensors, str(tmp), metadata={"ids": json.dumps(ids)})


def read_manifest(features_dir: str | Path) -> dict[str, Any]:
    path = Path(features_dir) / MANIFEST
    if not path.exists():
        raise DataError(f"no precomputed features at {features_dir} (no {MANIFEST}): run the features stage "
                        "first (dvc repro features) or train with distill.teacher=live")
    return json.loads(path.read_text())


class FeatureStore:
    """Reads a split of the store by row id; shards open lazily (and reopen in a DataLoader worker)."""

    def __init__(self, features_dir: str | Path, split: str):
        self.folder = Path(features_dir) / split
        self.manifest = read_manifest(features_dir)
        self.layers: list[int] = list(self.manifest["layers"])
        self.shards = sorted(self.folder.glob("shard-*.safetensors"))
        if not self.shards:
            raise DataError(f"no feature shards in {self.folder}: run the features stage with its split listed "
                            "(features.splits)")
        self._handles: list[Any] | None = None
        self._index: dict[str, tuple[int, int, int, int, int]] = {}  # id -> shard, feature row, topk row, p', r'
        for s, path in enumerate(self.shards):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                ids = json.loads(f.metadata()["ids"])
                pk, rk = f.get_tensor("prompt_kept").numpy(), f.get_tensor("response_kept").numpy()
            starts, tstarts = np.concatenate([[0], np.cumsum(pk + rk)]), np.concatenate([[0], np.cumsum(rk)])
            for j, rid in enumerate(ids):
                if rid in self._index:
                    raise DataError(f"row id {rid!r} repeats in {self.folder}: the store finds rows by id")
                self._index[rid] = (s, int(starts[j]), int(tstarts[j]), int(pk[j]), int(rk[j]))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": None}  # file handles do not cross into worker processes

    def _handle(self, s: int) -> Any:
        from safetensors import safe_open

        if self._handles is None:
            self._handles = [safe_open(str(p), framework="pt") for p in self.shards]
        return self._handles[s]

    def row(self, rid: str, p: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features [p+r, F], topk_ids [r, k], topk_logprobs [r, k]) of row `rid` kept as (p, r)."""
        if rid not in self._index:
            raise DataError(f"row {rid!r} has no precomputed features in {self.folder}: the store was made from "
                            "other generated data; rerun the features stage (dvc repro features)")
        s, start, tstart, pk, rk = self._index[rid]
        if (pk, rk) != (p, r):
            raise DataError(f"row {rid!r}: features stored for {pk}+{rk} prompt+response tokens, "
                            f"the batch keeps {p}+{r} "
                            "(another distill.data.max_length): rerun the features stage")
        f = self._handle(s)
        return (f.get_slice("features")[start:start + p + r], f.get_slice("topk_ids")[tstart:tstart + r],
                f.get_slice("topk_logprobs")[tstart:tstart + r])


def check_store(features_dir: str | Path, need_layers: list[int], max_length: int, generated_fingerprint: str,
                target_fingerprint: str) -> dict[str, Any]:
    """The store's manifest if it serves a run of this target that reads `need_layers` with this max_length and data."""
    fix = "rerun the features stage (dvc repro features) or train with distill.teacher=live"
    m = read_manifest(features_dir)
    if m.get("generated_fingerprint") != generated_fingerprint:
        raise DataError(f"the features at {features_dir} were computed from other generated data: {fix}")
    if m.get("target_fingerprint") != target_fingerprint:
        raise DataError(f"the features at {features_dir} were computed by another target: {fix}")
    if m.get("max_length") != max_length:
        raise DataError(f"the features at {features_dir} keep sequences of at most {m.get('max_length')} tokens, "
                        f"distill.data.max_length is {max_length}: {fix}")
    missing = [x for x in need_layers if x not in m.get("layers", [])]
    if missing:
        raise DataError(f"the features at {features_dir} hold layers {m.get('layers')}, the head reads {need_layers} "
                        f"(missing {missing}): add them to features.layers and {fix}")
    return m
