"""The separate draft as a plain HF folder: what `transformers` takes as `assistant_model` and vLLM as its
`draft_model` (`speculative_config={"method": "draft_model", "model": <folder>}`).

Both need the draft to score the target's whole vocabulary: vLLM compares the two `vocab_size`s, HF assisted
generation compares logits position by position. A draft trained with a reduced head (its `d2t` map) cannot be
widened after the fact: a plain LM head has no bias, so the rows added for the tokens it never scored would
give logit 0 and win wherever its own logits are negative. So the export takes a full-vocabulary draft
(`train@draft_full`, `methods.draft.vocab_size=null`) and refuses a reduced one, naming that fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specdistill.core.io import atomic_path
from specdistill.core.models.heads_io import SETTINGS_FILE
from specdistill.export.target import ExportError
from specdistill.methods.draft.model import load_draft


def export_draft(draft_dir: str | Path, out_dir: str | Path, target_dir: str | Path) -> Path:
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    if not (target_dir / "config.json").exists():
        raise ExportError(f"no exported target at {target_dir}: run `dvc repro export_target` first")
    draft = load_draft(draft_dir, dtype=torch.float32)
    t = json.loads((target_dir / "config.json").read_text())
    if getattr(draft, "d2t", None) is not None:
        raise ExportError(f"the draft at {draft_dir} scores {len(draft.d2t)} of the target's {t.get('vocab_size')} "
                          f"tokens (a reduced head): vLLM's draft_model and HF assisted generation need the full "
                          f"vocabulary, and a plain LM head has no bias to keep the tokens it never scored from "
                          f"winning. Train the full-vocabulary variant (`dvc repro train@draft_full`, "
                          f"methods.draft.vocab_size=null) and export that")
    vocab = draft.get_output_embeddings().weight.shape[0]
    if vocab != t.get("vocab_size"):
        raise ExportError(f"the draft at {draft_dir} has a {vocab}-token vocabulary, the target at {target_dir} "
                          f"{t.get('vocab_size')}: a draft must share the target's tokenizer")
    with atomic_path(out_dir, is_dir=True) as tmp:
        draft.save_pretrained(tmp)
        for f in target_dir.iterdir():  # the target's tokenizer: the engine drafts in the target's token ids
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(f, tmp / f.name)
        if (draft_dir / SETTINGS_FILE).exists():
            shutil.copy2(draft_dir / SETTINGS_FILE, tmp / SETTINGS_FILE)
    return Path(out_dir)
