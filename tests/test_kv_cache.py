"""PreallocatedCache gives the model exactly what DynamicCache gives it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdistill.core.models.kv_cache import PreallocatedCache


def run(model, cache, ids, mask):
    return model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits


def test_prefill_decode_crop_and_batch_select_match_dynamic_cache(tiny_model):
    torch.manual_seed(0)
    v = tiny_model.config.vocab_size
    ids = torch.randint(3, v, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    dyn, pre = DynamicCache(config=tiny_model.config), PreallocatedCache(tiny_model.config.num_hidden_layers, 40)
    with torch.no_grad():
        assert torch.allclose(run(tiny_model, dyn, ids, mask), run(tiny_model, pre, ids, mask), atol=1e-6)
        for _ in range(3):
            step = torch.randint(3, v, (3, 2))
            mask = torch.cat([mask, torch.ones(3, 2, dtype=torch.long)], 1)
            assert torch.allclose(run(tiny_model, dyn, step, mask), run(tiny_model, pre, step, mask), atol=1e-5)
        dyn.crop(-3)
        pre.crop(-3)
        mask = mask[:, :-3]
        assert pre.get_seq_length() == dyn.get_seq_length() == 12
        keep = torch.tensor([0, 2])
        dyn.batch_select_indices(keep)
        pre.batch_select_indices(keep)
        mask = torch.cat([mask[keep], torch.ones(2, 1, dtype=torch.long)], 1)
        step = torch.randint(3, v, (2, 1))
        assert torch.allclose(run(tiny_model, dyn, step, mask), run(tiny_model, pre, step, mask), atol=1e-5)


def test_gather_positions_keeps_a_path(tiny_model):
    """After writing 4 candidate tokens, keeping positions [p+1, p+3] equals decoding those two plainly."""
    torch.manual_seed(1)
    v = tiny_model.config.vocab_size
    prefix, cand = torch.randint(3, v, (1, 6)), torch.randint(3, v, (1, 4))
    n = tiny_model.config.num_hidden_layers
    with torch.no_grad():
        a = PreallocatedCache(n, 32)
        tiny_model(input_ids=prefix, cache=a, use_cache=True)
        tiny_model(input_ids=cand, cache=a, use_cache=True)  # plain causal here; positions 6..9
        a.gather_positions(torch.tensor([6, 7]), start=6)
        b = PreallocatedCache(n, 32)
        tiny_model(input_ids=torch.cat([prefix, cand[:, :2]], 1), cache=b, use_cache=True)
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert torch.allclose(la.keys, lb.keys, atol=1e-6) and torch.allclose(la.values, lb.values, atol=1e-6)


def test_capacity_overflow_is_a_clear_error(tiny_model):
    import pytest

    cache = PreallocatedCache(tiny_model.config.num_hidden_layers, 4)
    with pytest.raises(RuntimeError, match="capacity 4 exceeded"), torch.no_grad():
        tiny_model(input_ids=torch.ones(1, 5, dtype=torch.long), cache=cache, use_cache=True)


def test_transformers_older_than_the_cache_keyword_is_refused():
    from specdistill.core.models import require_transformers

    require_transformers("5.24.0")
    require_transformers("5.30.1")
    with pytest.raises(ImportError, match=r"transformers>=5.24 \(found 5.23.0\).*pip install -U"):
        require_transformers("5.23.0")
