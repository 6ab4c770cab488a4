"""DistillSpec data: the draft's own continuations replace the batch's answers, masks rebuilt."""

from __future__ import annotations

import torch

from specdistill.methods.draft.model import DraftSize, build_draft
from specdistill.training.onpolicy import continue_prompts

from .helpers.models import make_model


def batch_of(prompts, pad=0):
    t = max(len(p) for p in prompts) + 3
    ids = torch.full((len(prompts), t), pad)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        ids[i, len(p):len(p) + 3] = 7  # an old answer that must disappear
    return {"input_ids": ids, "prompt_len": torch.tensor([len(p) for p in prompts])}


def test_continuations_equal_each_prompts_own_greedy_decoding(tiny_tokenizer):
    """Prompts of different lengths share one left-padded batch: each row must still decode as if alone."""
    draft = make_model(len(tiny_tokenizer), seed=3, layers=1)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21]]
    out = continue_prompts(draft, batch_of(prompts), 6, stops=set(), pad_id=0, temperature=1e-4)
    for i, p in enumerate(prompts):
        alone = draft.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, pad_token_id=0,
                               eos_token_id=None)[0].tolist()
        n = int(out["length"][i])
        assert out["input_ids"][i, :n].tolist() == alone
        assert out["loss_mask"][i].nonzero().flatten().tolist() == list(range(len(p) - 1, n - 1))
        assert out["labels"][i, len(p) - 1:n - 1].tolist() == alone[len(p):]
        assert (out["attention_mask"][i, :n] == 1).all() and (out["attention_mask"][i, n:] == 0).all()


def test_stops_cut_rows_and_d2t_maps_to_target_ids(tiny_tokenizer):
    v = len(tiny_tokenizer)
    d2t = torch.arange(0, v, 5)
    # full input embeddings, a head over the reduced vocabulary only
    draft = build_draft(make_model(v, seed=4), DraftSize("xs", num_layers=1), "from_target", d2t=d2t)
    g = torch.Generator().manual_seed(0)
    out = continue_prompts(draft, batch_of([[5, 6], [8, 9, 10]]), 40, stops={int(d2t[3])}, pad_id=0, d2t=d2t,
                           generator=g)
    for i, p in enumerate([2, 3]):
        resp = out["input_ids"][i, p:int(out["length"][i])].tolist()
        assert 1 <= len(resp) <= 40 and all(t % 5 == 0 for t in resp)
        assert int(d2t[3]) not in resp[:-1]  # a row ends at its first stop token
    again = continue_prompts(draft, batch_of([[5, 6], [8, 9, 10]]), 40, stops={int(d2t[3])}, pad_id=0, d2t=d2t,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(again["input_ids"], out["input_ids"])  # seeded: a resumed run samples the same
