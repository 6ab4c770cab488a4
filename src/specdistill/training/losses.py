"""Divergences for distilling a draft (student, distribution q) from a frozen target (teacher, p).

One registry, `LOSSES`, built by name through `build_loss`:

- ``fkl``: forward KL(p || q), the classic knowledge-distillation loss (Hinton et al., 2015, "Distilling
  the Knowledge in a Neural Network"). Mass-covering: q is punished wherever p has mass q lacks.
- ``rkl``: reverse KL(q || p), mode-seeking (MiniLLM, Gu et al., 2024; also a GKD variant).
- ``jsd``: the generalised Jensen-Shannon divergence of GKD (Agarwal et al., 2024, "On-Policy
  Distillation of Language Models"), JSD_beta = beta KL(p || m) + (1-beta) KL(q || m) with
  m = beta p + (1-beta) q; DistillSpec (Zhou et al., 2024) uses it for drafts. Bounded by H(beta).
- ``tvd``: total variation 0.5 sum |p - q|. Speculative sampling accepts a drafted token with probability
  sum min(p, q) = 1 - TVD (Leviathan et al., 2023; Chen et al., 2023), so DistillSpec trains on it directly.
- ``topk_kl``: forward KL against the teacher's top-k renormalised, for offline distillation from the
  top-k log-probs the generate stage stored (no live target needed).
- ``ce``: hard cross-entropy on the generated tokens: sequence-level KD (Kim & Rush, 2016).
- ``lk``: the LK losses (Samarin et al., 2026, "LK Losses: Direct Acceptance Rate Optimization for
  Speculative Decoding"), which target the acceptance rate alpha = sum min(p, q) = 1 - TVD itself.
  ``variant: alpha`` is -log alpha per token: its gradient is TVD's scaled by 1 / alpha, so it pushes hardest
  where acceptance is low (plain TVD's gradient vanishes for a large vocabulary at initialisation).
  ``variant: lambda`` is the hybrid lambda KL(p || q) + (1 - lambda) TVD with lambda = exp(-eta sg[alpha]),
  alpha the batch's mean acceptance (one lambda per call, as the paper's schedule and SpecForge compute it:
  a training-time-test step is one call): KL leads while acceptance is low, TVD takes over as it rises.

The temperature divides both the student's and the teacher's logits. With it on one side only, the
minimiser would be a sharpened or flattened copy of the target rather than the target; on both sides the
loss is still zero exactly when the student's logits equal the teacher's (up to a shift), and a draft
meant for sampling at temperature T is compared with the target as the decoder will see both: the
acceptance rate at T is 1 - TVD(p_T, q_T). No T^2 gradient rescaling (Hinton) is applied.

Everything is computed in float32 from log_softmax (bf16 logits lose the tail, and exp-then-log
underflows). Gradients reach the student's logits only: teacher tensors are detached.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor


class LossError(ValueError):
    """A loss that cannot be built, or cannot be computed from the teacher it was given."""


@dataclass
class Teacher:
    """What the target says at N positions: live dense logits, or the stored top-k of the generate stage."""

    logits: Tensor | None = None  # [N, V] live frozen-target forward
    topk_ids: Tensor | None = None  # [N, k] long, stored by the generate stage
    topk_logprobs: Tensor | None = None  # [N, k] log-probs at temperature 1, before any warping

    def __post_init__(self) -> None:
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            raise LossError("Teacher needs both topk_ids and topk_logprobs, or neither")

    @property
    def is_dense(self) -> bool:
        return self.logits is not None

    def _need_some(self) -> None:
        if self.logits is None and self.topk_ids is None:
            raise LossError("Teacher has neither logits nor stored top-k log-probs")

    def select(self, index: Tensor) -> Teacher:
        """The rows picked by a bool mask or an index tensor (used to drop masked-out positions early)."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]

        return Teacher(pick(self.logits), pick(self.topk_ids), pick(self.topk_logprobs))

    def log_probs(self, temperature: float, vocab_size: int) -> Tensor:
        """Dense teacher log-probs [N, V] at the temperature; from stored top-k: -inf off the top-k."""
        self._need_some()
        if self.logits is not None:
            if self.logits.shape[-1] != vocab_size:
                raise LossError(f"teacher vocabulary {self.logits.shape[-1]} != student vocabulary {vocab_size}")
            return torch.log_softmax(self.logits.detach().float() / temperature, dim=-1)
        # log p_i / T differs from z_i / T by a per-row constant, so renormalising the scaled stored
        # log-probs gives exactly softmax(z / T) restricted to the top-k and renormalised.
        lp = torch.log_softmax(self.topk_logprobs.detach().float() / temperature, dim=-1)
        full = lp.new_full((lp.shape[0], vocab_size), -math.inf)
        return full.scatter(-1, self.topk_ids.long(), lp)

    def topk(self, k: int, temperature: float) -> tuple[Tensor, Tensor]:
        """The teacher's k most likely ids [N, k] and their log-probs renormalised over those k."""
        self._need_some()
        if self.logits is not None:
            z = self.logits.detach().float()
            vals, ids = z.topk(min(k, z.shape[-1]), dim=-1)  # the ranking does not depend on T > 0
        else:
            stored = self.topk_logprobs.shape[-1]
            if k > stored:
                raise LossError(f"topk_kl k={k} exceeds the {stored} stored top-k log-probs "
                                "(raise generate.topk_logprobs or lower k)")
            # topk again rather than slicing: does not rely on the stored order being sorted
            vals, pos = self.topk_logprobs.detach().float().topk(k, dim=-1)
            ids = self.topk_ids.long().gather(-1, pos)
        return ids, torch.log_softmax(vals / temperature, dim=-1)


def masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of values [N] over mask [N] (all if None); 0, still attached to the graph, if nothing is kept."""
    if mask is not None:
        values = values[mask.bool()]
    return values.sum() / max(values.numel(), 1)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Row-wise KL(a || b) from log-probs; entries with a = 0 contribute 0 (0 log 0 = 0, even against -inf)."""
    terms = log_a.exp() * (log_a - log_b)
    return torch.where(torch.isneginf(log_a), 0.0, terms).sum(-1)


class Divergence(torch.nn.Module):
    """Base: per-token divergence between student and teacher at one temperature, and its masked mean."""

    name: str = ""
    needs_full_teacher: bool = False  # True: p over the whole vocabulary is needed (no stored top-k)

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not _is_real(temperature) or not math.isfinite(temperature) or temperature <= 0:
            raise LossError(f"{self.name}: temperature must be a finite number > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"

    def student_log_probs(self, student_logits: Tensor) -> Tensor:
        return torch.log_softmax(student_logits.float() / self.temperature, dim=-1)

    def teacher_log_probs(self, teacher: Teacher, vocab_size: int) -> Tensor:
        if self.needs_full_teacher and not teacher.is_dense:
            raise LossError(f"{self.name} needs the full teacher distribution, which stored top-k log-probs "
                            "do not give; use the live target (distill.teacher=live) or fkl/topk_kl/ce")
        return teacher.log_probs(self.temperature, vocab_size)

    def per_token(self, student_logits: Tensor, teacher: Teacher, targets: Tensor | None = None) -> Tensor:
        """Unreduced float32 divergence per position, [N]."""
        raise NotImplementedError

    def forward(self, student_logits: Tensor, teacher: Teacher, mask: Tensor | None = None,
                targets: Tensor | None = None, weights: Tensor | None = None) -> Tensor:
        """The mean over kept positions of the per-token divergence, each times its weight when `weights` [N] is
        given (position weights such as D-PACE's: detached, they only scale)."""
        if mask is not None:
            # Drop masked-out rows before computing: padding costs nothing, and garbage there (NaN, -inf
            # rows of padded stored top-k) cannot leak into the loss or its gradient through 0 * NaN.
            mask = mask.bool()
            student_logits = student_logits[mask]
            teacher = teacher.select(mask) if teacher is not None else None
            targets = targets[mask] if targets is not None else None
            weights = weights[mask] if weights is not None else None
        values = self.per_token(student_logits, teacher, targets)
        return masked_mean(values if weights is None else values * weights.detach().float(), None)


LOSSES: dict[str, type[Divergence]] = {}


def _register(cls: type[Divergence]) -> type[Divergence]:
    LOSSES[cls.name] = cls
    return cls


@_register
class ForwardKL(Divergence):
    name = "fkl"

    def per_token(self, student_logits, teacher, targets=None):
        lq = self.student_log_probs(student_logits)
        return _kl(self.teacher_log_probs(teacher, lq.shape[-1]), lq)


@_register
class ReverseKL(Divergence):
    name = "rkl"
    needs_full_teacher = True

    def per_token(self, student_logits, teacher, targets=None):
        lq = self.student_log_probs(student_logits)
        return _kl(lq, self.teacher_log_probs(teacher, lq.shape[-1]))


@_register
class GeneralisedJSD(Divergence):
    name = "jsd"
    needs_full_teacher = True

    def __init__(self, temperature: float = 1.0, beta: float = 0.5) -> None:
        super().__init__(temperature)
        if not _is_real(beta) or not 0.0 < beta < 1.0:
            # at 0 or 1 the mixture is one of the two distributions and the divergence is identically 0
            raise LossError(f"jsd: beta must lie strictly between 0 and 1, got {beta!r}")
        self.beta = float(beta)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, beta={self.beta}"

    def per_token(self, student_logits, teacher, targets=None):
        lq = self.student_log_probs(student_logits)
        lp = self.teacher_log_probs(teacher, lq.shape[-1])
        # log m in log space: mixing probabilities directly would underflow the tail to log 0
        lm = torch.logsumexp(torch.stack([lp + math.log(self.beta), lq + math.log1p(-self.beta)]), dim=0)
        return self.beta * _kl(lp, lm) + (1.0 - self.beta) * _kl(lq, lm)


@_register
class TotalVariation(Divergence):
    name = "tvd"
    needs_full_teacher = True

    def per_token(self, student_logits, teacher, targets=None):
        lq = self.student_log_probs(student_logits)
        p = self.teacher_log_probs(teacher, lq.shape[-1]).exp()
        return 0.5 * (p - lq.exp()).abs().sum(-1)


@_register
class TopKForwardKL(Divergence):
    name = "topk_kl"

    def __init__(self, temperature: float = 1.0, k: int = 32) -> None:
        super().__init__(temperature)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise LossError(f"topk_kl: k must be an integer >= 1, got {k!r}")
        self.k = int(k)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, k={self.k}"

    def per_token(self, student_logits, teacher, targets=None):
        # q stays the full-vocabulary softmax (not renormalised over the k ids): its mass off the top-k
        # is then penalised too, and the loss stays >= 0 because sum q over the k ids <= 1 (Gibbs).
        lq = self.student_log_probs(student_logits)
        ids, lpk = teacher.topk(self.k, self.temperature)
        return _kl(lpk, lq.gather(-1, ids))


@_register
class CrossEntropy(Divergence):
    name = "ce"

    def per_token(self, student_logits, teacher=None, targets=None):
        if targets is None:
            raise LossError("ce needs targets (the generated tokens); the teacher is not used")
        lq = self.student_log_probs(student_logits)
        return -lq.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def dpace_weights(confidence: list[Tensor], valid: list[Tensor], alpha: float = 0.5) -> list[Tensor]:
    """D-PACE position weights (arXiv 2605.18810; ModelOpt's and speculators' default DFlash objective) for the
    positions 1..S of a drafted block (here the training-time-test steps of an anchor).

    With q_i the draft's own probability of the true token at position i (detached) and q~_i = (1 - alpha) q_i
    + alpha, w_j = sum_{m >= j} prod_{i <= m} q~_i: the expected number of positions from j on that the draft
    would still reach, so position 1 weighs most and a position the draft rarely reaches little. A position with
    no target counts 1 in the products and is left out of the sums. `confidence` and `valid` are per position
    tensors of one shape (e.g. [B, T] anchors); the weights come back in that shape."""
    if not 0 < alpha <= 1:
        raise LossError(f"dpace: alpha must lie in (0, 1], got {alpha!r}")
    reach, running = [], None
    for q, ok in zip(confidence, valid, strict=True):
        q_tilde = torch.where(ok, (1 - alpha) * q.detach().float() + alpha, torch.ones_like(q, dtype=torch.float32))
        running = q_tilde if running is None else running * q_tilde
        reach.append(torch.where(ok, running, torch.zeros_like(running)))
    weights, tail = [], None
    for r in reversed(reach):
        tail = r if tail is None else tail + r
        weights.append(tail)
    return [w * ok for w, ok in zip(reversed(weights), valid, strict=True)]


def acceptance(lp: Tensor, lq: Tensor) -> Tensor:
    """alpha = sum_x min(p(x), q(x)) per row from log-probs: the probability speculative sampling accepts a
    token drafted from q against p (= 1 - TVD(p, q))."""
    return torch.minimum(lp, lq).exp().sum(-1)


@_register
class LKLoss(Divergence):
    name = "lk"
    needs_full_teacher = True  # alpha needs p over the whole (draft) vocabulary
    VARIANTS = ("lambda", "alpha")

    def __init__(self, temperature: float = 1.0, variant: str = "lambda", eta: float = 3.0) -> None:
        super().__init__(temperature)
        if variant not in self.VARIANTS:
            raise LossError(f"lk: variant must be one of {self.VARIANTS}, got {variant!r}")
        if not _is_real(eta) or not math.isfinite(eta) or eta < 0:
            raise LossError(f"lk: eta must be a finite number >= 0, got {eta!r}")
        self.variant, self.eta = variant, float(eta)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, variant={self.variant}, eta={self.eta}"

    def per_token(self, student_logits, teacher, targets=None):
        lq = self.student_log_probs(student_logits)
        lp = self.teacher_log_probs(teacher, lq.shape[-1])
        alpha = acceptance(lp, lq)
        if self.variant == "alpha":
            return -torch.log(alpha.clamp_min(1e-6))  # clamped: a row with no overlap has no direction anyway
        lam = torch.exp(-self.eta * alpha.detach().mean()) if alpha.numel() else alpha.new_ones(())
        return lam * _kl(lp, lq) + (1 - lam) * (1 - alpha)


def build_loss(name: str, temperature: float = 1.0, **params) -> Divergence:
    """The divergence registered as `name`, e.g. build_loss("jsd", temperature=1.0, beta=0.5)."""
    if name not in LOSSES:
        raise LossError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}")
    cls = LOSSES[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "temperature")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise LossError(f"{name}: unknown parameter(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join(accepted) or 'none besides temperature'}")
    return cls(temperature=temperature, **params)
