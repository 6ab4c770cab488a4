"""On-policy data from the draft itself (DistillSpec, Agarwal et al. 2024 / GKD): the draft samples the
continuation of each prompt, the frozen target scores it, and the draft is distilled on its own tokens.

A draft is judged on the contexts it creates: drafted tokens the target accepts are the draft's, so
training on the target's answers alone leaves the draft's own mistakes unseen. `continue_prompts`
replaces the responses of a batch with fresh samples of the current draft (temperature 1, over its
own vocabulary mapped back to target ids through d2t) and rebuilds the masks the loss reads.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.core.data.datamodule import next_token_labels


@torch.no_grad()
def continue_prompts(draft: Any, batch: dict[str, torch.Tensor], max_new_tokens: int, stops: set[int],
                     pad_id: int, d2t: torch.Tensor | None = None, generator: torch.Generator | None = None,
                     temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """The batch's prompts, each followed by a sampled draft continuation (ending at a stop token or the cap)."""
    from transformers import DynamicCache

    device = batch["input_ids"].device
    plen = batch["prompt_len"].tolist()
    b, width = len(plen), max(plen)
    # left-padded prompts so every row's next token is sampled at the same column
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, width), dtype=torch.long, device=device)
    for i, p in enumerate(plen):
        ids[i, width - p:] = batch["input_ids"][i, :p]
        mask[i, width - p:] = 1
    was_training = draft.training
    draft.eval()
    cache = DynamicCache()
    responses: list[list[int]] = [[] for _ in range(b)]
    alive = torch.ones(b, dtype=torch.bool, device=device)
    x, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    stop_t = torch.tensor(sorted(stops), device=device)
    for _ in range(max_new_tokens):
        out = draft(input_ids=x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        logits = out.logits[:, -1].float() / temperature
        tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        if d2t is not None:
            tok = d2t.to(device)[tok]
        for i in torch.nonzero(alive).flatten().tolist():
            responses[i].append(int(tok[i]))
        alive &= ~torch.isin(tok, stop_t)
        if not bool(alive.any()):
            break
        x = tok[:, None]
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long, device=device)], dim=1)
        positions = positions[:, -1:] + 1
    draft.train(was_training)
    return rebuild(batch, responses, pad_id)


def rebuild(batch: dict[str, torch.Tensor], responses: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch in the datamodule's layout: prompt + response right-padded, loss on the response tokens."""
    device = batch["input_ids"].device
    plen = batch["prompt_len"].tolist()
    lengths = [p + len(r) for p, r in zip(plen, responses, strict=True)]
    b, t = len(plen), max(lengths)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((b, t), dtype=torch.long, device=device)
    loss_mask = torch.zeros((b, t), dtype=torch.bool, device=device)
    for i, (p, r) in enumerate(zip(plen, responses, strict=True)):
        input_ids[i, :p] = batch["input_ids"][i, :p]
        input_ids[i, p:p + len(r)] = torch.tensor(r, dtype=torch.long, device=device)
        attention[i, :p + len(r)] = 1
        loss_mask[i, p - 1:p + len(r) - 1] = True
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
            "labels": next_token_labels(input_ids, loss_mask),
            "prompt_len": batch["prompt_len"], "length": torch.tensor(lengths, device=device)}
