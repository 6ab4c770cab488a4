"""XPress's causal refiner (arXiv 2608.02438; speculators 0.9.0 `speculators_model_type: xpress`): a low-rank head over
a DFlash block that adds a logit bias to each slot from the token before it, the slot's own state and the block's mean
state, mixed causally across the block, so a slot sees what was drawn before it, which the parallel block cannot.

For slot k of a block, with prev_k the target id before the slot (the anchor's own predecessor for slot 0):

    a_k = W_in [down_h(h_k) ; down_g(mean_j h_j) ; E(prev_k)]          (rank r)
    c_k = a_k + sum_{j <= k} L[:, k, j] * a_j                             (the causal mixer, per rank channel)
    bias_k = readout(c_k + down(silu(gate(c_k)) * up(c_k)))              (over the draft vocabulary)

Slot k's bias reads prev_0..prev_k only, so drafting resolves the block slot by slot exactly (each slot's bias from
the tokens drawn before it), which is the fixed point XPress's parallel Jacobi passes converge to. `L` and the
refiner start small (L at zero), so a new refiner begins close to the plain block drafter. Tensor names follow
speculators' `XPressRefinerHead`, so the export is a rename of the prefix.
"""

from __future__ import annotations

import torch
from torch import nn


class XPressRefiner(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, hidden_size: int, block_size: int, rank: int,
                 mlp_ratio: int = 2):
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, rank)  # over the target's ids: any token can precede a slot
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, draft_vocab_size, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(block_size, block_size)), persistent=False)
        for module in self.modules():  # small, as the reference recipe starts it
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, prev: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The bias [N, S, V'] on the slots of N blocks from `prev` [N, S] (the target id before each slot) and the
        blocks' normed slot states [N, S, H]."""
        states = states.to(self.down_h.weight.dtype)
        summary = states.mean(dim=1, keepdim=True).expand_as(states)
        a = self.in_proj(torch.cat([self.down_h(states), self.down_g(summary), self.token_embed(prev)], dim=-1))
        n = a.shape[1]  # a block drafting fewer slots than block_size uses the mixer's leading corner
        mix = (self.mix_l * self.causal)[:, :n, :n]
        c = a + torch.einsum("rkj,njr->nkr", mix, a)
        c = c + self.mlp_down(torch.nn.functional.silu(self.mlp_gate(c)) * self.mlp_up(c))
        return self.readout(c)
