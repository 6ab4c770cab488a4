"""A GGUF target's dequantised copy, kept in a cache so that each later process loads it in a second.

Every stage item is its own process, and a GGUF target costs each one three reads of the file (config, tokenizer,
weights; 10-15 s on 2 cores, the tokenizer's merges parsed in Python and every tensor dequantised). The first load
writes the weights as loaded (at the target's dtype), the config and the tokenizer to a folder named after the
GGUF's sha256, the dtype and the transformers version that dequantised it; later loads read that folder. The
target's identity stays the GGUF's sha256, so fingerprints, DVC and the drafts' lineage are as before.

Where: `$SPECDISTILL_CACHE/targets/`, else `$XDG_CACHE_HOME/specdistill/targets/` (`~/.cache/...`);
`SPECDISTILL_CACHE=off` loads from the GGUF every time. A folder is only ever renamed into place whole.
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

from specdistill.core.io import CACHE_ENV, cache_root, sha256_cached  # noqa: F401 (CACHE_ENV: the tests set it)
from specdistill.core.models.hf_folder import folder_info, hf_state, write_hf_folder

log = logging.getLogger(__name__)

@lru_cache(maxsize=8)
def _gguf_sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_cached(path)


def gguf_sha256(path: Path) -> str:
    """The file's sha256: read once (io.sha256_cached keeps it across processes under the file's stat, so a replaced
    file is hashed again), then remembered for the process."""
    st = path.stat()
    return _gguf_sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


def folder_for(gguf: Path, dtype: str) -> Path | None:
    """Where the dequantised copy of `gguf` at `dtype` lives (whether or not it is there yet)."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    return root / "targets" / f"{gguf_sha256(gguf)[:32]}-{dtype}-transformers{transformers.__version__}"


def cached(gguf: Path, dtype: str) -> Path | None:
    """The complete dequantised copy, or None (no cache, not written yet, or a folder from something else)."""
    folder = folder_for(gguf, dtype)
    if folder is None or not (folder / "model.safetensors").exists():
        return None
    if folder_info(folder).get("target_fingerprint") != "sha256:" + gguf_sha256(gguf):
        log.warning("ignoring %s: it does not name %s as its source; delete it", folder, gguf)
        return None
    return folder


def write(model: Any, tokenizer: Any, gguf: Path, dtype: str, fingerprint: str) -> None:
    """Keep the dequantised copy for the next process. Best effort: a cache that cannot be written costs time, so
    it is logged, never raised; two processes that both write it keep the first one's."""
    import torch

    folder = folder_for(gguf, dtype)
    if folder is None or folder.exists():
        return
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        state, config = hf_state(model, getattr(torch, dtype))
        write_hf_folder(state, config, tokenizer, tmp, {"target_fingerprint": fingerprint, "dtype": dtype})
        os.rename(tmp, folder)  # refused when another process renamed its copy first: that one stays
        log.info("target: dequantised copy kept in %s (later loads read it; %s=off to skip)", folder, CACHE_ENV)
    except OSError as e:
        log.warning("target: could not keep a dequantised copy in %s (%s); each load reads the GGUF", folder, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
