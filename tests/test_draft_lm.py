"""The draft LM: sizes, initialisation from the target, reduced vocabulary, save/load, decoding with it."""

from __future__ import annotations

import pytest
import torch

from specdistill.core.errors import ConfigError
from specdistill.core.models.vocab import draft_vocabulary
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.draft.model import (
    DraftError,
    DraftSize,
    build_draft,
    check_same_vocabulary,
    load_draft,
    save_draft,
)
from specdistill.methods.draft.proposer import DraftLMProposer

from .helpers.models import make_model


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    return make_model(len(tiny_tokenizer), layers=4)


def test_from_target_copies_embeddings_head_and_first_layers(target):
    draft = build_draft(target, DraftSize("s", num_layers=2), "from_target")
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == target.config.vocab_size
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    for i, j in [(0, 0), (1, 1)]:
        for a, b in zip(draft.model.layers[i].parameters(), target.model.layers[j].parameters(), strict=True):
            assert torch.equal(a, b)
    assert all(p.requires_grad for p in draft.parameters())
    rand = build_draft(target, DraftSize("s", num_layers=2), "random")
    assert not torch.equal(rand.lm_head.weight, target.lm_head.weight)


def test_bad_sizes_fail_clearly(target):
    with pytest.raises(DraftError, match="needs the target's width"):
        build_draft(target, DraftSize("x", num_layers=1, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2), "from_target")
    with pytest.raises(DraftError, match="init"):
        build_draft(target, DraftSize(), "copy")
    with pytest.raises(DraftError, match="num_layers"):
        build_draft(target, DraftSize(num_layers=0))


def test_draft_vocabulary_keeps_frequent_and_stop_tokens():
    d2t = draft_vocabulary([[5, 5, 5, 7, 7, 9], [5, 7, 11]], 3, 16, always=[2])
    assert d2t.tolist() == [2, 5, 7]
    with pytest.raises(ConfigError, match="vocab_size"):
        draft_vocabulary([[1]], 0, 16)


@pytest.mark.parametrize("reduced", [False, True])
def test_save_load_round_trip(target, tmp_path, tiny_tokenizer, reduced):
    d2t = torch.arange(0, target.config.vocab_size, 3) if reduced else None
    draft = build_draft(target, DraftSize("xs", num_layers=1), "from_target", d2t=d2t).eval()
    save_draft(draft, tmp_path / "d", tiny_tokenizer, extra={"loss": {"name": "fkl"}})
    back = load_draft(tmp_path / "d")
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, draft(x).logits)
    check_same_vocabulary(back, target)
    if reduced:
        assert torch.equal(back.d2t, d2t) and back.lm_head.weight.shape[0] == len(d2t)
        assert torch.equal(back.lm_head.weight, target.lm_head.weight[d2t])
    else:  # a plain HF folder: transformers loads it without our code
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tmp_path / "d")


def test_foreign_vocabulary_is_refused(target):
    other = make_model(100)
    with pytest.raises(DraftError, match="share the target's tokenizer"):
        check_same_vocabulary(other, target)
    with pytest.raises(DraftError, match="no draft at"):
        load_draft("/nonexistent/draft")


def test_reduced_vocabulary_draft_decodes_losslessly(target):
    """Greedy decoding with a reduced-vocabulary draft equals plain greedy decoding, and drafts are accepted."""
    vocab = target.config.vocab_size
    prompt = [5, 17, 33, 8]
    with torch.no_grad():
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, pad_token_id=2,
                                eos_token_id=None)[0, len(prompt):].tolist()
    keep = sorted(set(plain) | set(range(0, vocab, 2)))  # covers the target's own path: high acceptance
    draft = build_draft(target, DraftSize("m", num_layers=4), "from_target", d2t=torch.tensor(keep)).eval()
    for shape in [dict(k=4), dict(branching=[2, 2, 1])]:
        res = speculative_generate(TargetVerifier(target, 128), DraftLMProposer(draft, **shape), prompt, 20, set())
        assert res.tokens == plain
        assert res.tau > 2.5
    res = speculative_generate(TargetVerifier(target, 128), DraftLMProposer(draft, k=4), prompt, 20, set(),
                               SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert len(res.tokens) == 20
