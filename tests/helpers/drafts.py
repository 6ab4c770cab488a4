"""Drafters for the tests: random heads and drafts for the tiny target (conftest's `target`), and random ones over
the bigram vocabulary for FeatureBigramVerifier (helpers/decoding.py)."""

from __future__ import annotations

import torch

from specdistill.core.models.hidden import HiddenTap
from specdistill.methods.dflash.model import DFlashConfig, DFlashDrafter, build_dflash
from specdistill.methods.draft.model import DraftSize, build_draft
from specdistill.methods.eagle.model import EagleConfig, EagleHead, build_eagle
from specdistill.methods.medusa.model import build_medusa

from .decoding import V

EAGLE_LAYERS = {"eagle1": [2], "eagle3": [0, 1, 2]}  # the tiny target has 2 layers


def random_head(target, variant, d2t=None, seed=0, scale=0.2):
    """A head with random weights; variant eagle3.1 is eagle3 with both EAGLE-3.1 flags."""
    v31 = variant == "eagle3.1"
    variant = "eagle3" if v31 else variant
    head = build_eagle(target, variant, EAGLE_LAYERS[variant], d2t, seed=seed, fc_norm=v31, norm_output=v31)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return head.eval()


def target_features(target, ids, layers):
    with HiddenTap(target, layers) as tap, torch.no_grad():
        target(input_ids=ids)
    return tap.concat()


def random_drafter(target, d2t=None, block=5, seed=0, scale=0.2, markov_rank=0, refiner_rank=0) -> DFlashDrafter:
    """A 2-layer DFlash block drafter with random weights over EAGLE-3's layers (with a Markov head: DSpark; with a
    causal refiner: XPress)."""
    drafter = build_dflash(target, EAGLE_LAYERS["eagle3"], num_layers=2, block_size=block, mask_token_id=1, d2t=d2t,
                           seed=seed, markov_rank=markov_rank, refiner_rank=refiner_rank)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return drafter.eval()


def random_heads(target, k=3, d2t=None, seed=0):
    heads = build_medusa(target, k, 1, d2t)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.eval()


def student(target, seed=3):
    """A 1-layer draft cut from the target, perturbed: it agrees with the target on some tokens, not all."""
    draft = build_draft(target, DraftSize(name="xs", num_layers=1), "from_target", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=g) * 0.5)
    return draft


def bigram_head() -> EagleHead:
    """A random head over the bigram vocabulary (`V`), for FeatureBigramVerifier's one-hot states."""
    cfg = EagleConfig(variant="eagle1", hidden_size=V, intermediate_size=16, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, vocab_size=V, feature_layers=[1], max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(V, V)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, V, generator=g))
    head = EagleHead(cfg, embed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return head.eval()


def bigram_drafter(block: int = 4, markov_rank: int = 0, refiner_rank: int = 0) -> DFlashDrafter:
    """A random drafter over the bigram vocabulary (`V`), for FeatureBigramVerifier's one-hot states."""
    cfg = DFlashConfig(hidden_size=V, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       num_layers=1, block_size=block, vocab_size=V, feature_layers=[1], max_position_embeddings=64,
                       markov_rank=markov_rank, refiner_rank=refiner_rank)
    g = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(V, V)
    drafter = DFlashDrafter(cfg, embed)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, V, generator=g))
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return drafter.eval()
