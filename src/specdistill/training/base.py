"""The distillation base every draft method extends: a frozen target, the masked loss, acceptance metrics.

A method says how its student turns a batch into logits at the loss positions (`student_logits`);
the base gets the teacher's logits there from the frozen target (live, the default) or from the
top-k the generate stage stored, applies the divergence from `losses.py`, and on validation
accumulates `AcceptanceMetric` over the full vocabulary. Optimizer and scheduler arrive as
factories (Hydra `_partial_` objects), so a config picks them without code here.

The target is held outside the module tree on purpose: it is frozen, so it must not enter the
optimizer, the checkpoint (270 MB of weights the target folder already has) or DDP's gradient sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import MeanMetric, Metric

from specdistill.core.models.vocab import target_to_draft, to_target_logits
from specdistill.training.losses import Divergence, Teacher
from specdistill.training.metrics import AcceptanceMetric

TEACHERS = ("live", "stored", "precomputed")  # precomputed: the features stage's store (EAGLE)


# optimizer and scheduler arguments a wrong value of which some factories accept silently (a negative warm-up
# trained with a learning rate above its peak) or reject without naming the argument
_POSITIVE = {"lr"}
_NON_NEGATIVE = {"weight_decay", "eps", "momentum", "num_warmup_steps", "num_training_steps", "num_cycles"}


def build_optimizer(spec: dict[str, Any], key: str, probe: bool = True) -> Callable[..., Any]:
    """A `_target_` / `_partial_` config (conf/optimizer/, distill.scheduler) as the factory Lightning's
    `configure_optimizers` calls. An optimizer (`probe`) is built once on a dummy parameter now, so a bad value
    (`lr=fast`) fails at start, before any checkpoint is touched; the error names the key."""
    import hydra.utils

    from specdistill.core.errors import ConfigError

    for arg, value in spec.items():  # each argument named: `lr=fast` once named only its section
        if arg.startswith("_"):
            continue
        if arg in _POSITIVE | _NON_NEGATIVE and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"`{key}.{arg}={value!r}`: must be a number")
        if arg in _POSITIVE and value <= 0 or arg in _NON_NEGATIVE and value < 0:
            raise ConfigError(f"`{key}.{arg}={value!r}`: must be {'> 0' if arg in _POSITIVE else '>= 0'}")
    try:
        factory = hydra.utils.instantiate(spec)
    except Exception as e:  # Hydra wraps an unknown _target_ or a bad argument in its own errors
        raise ConfigError(f"{key}={spec}: {e}") from e
    if probe:
        try:
            factory([torch.nn.Parameter(torch.zeros(1))])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}={spec}: {e}") from e
    return factory


def logits_at(model: Any, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """[N, V] logits of a causal LM at the N True positions of `mask` only: the full [B, T, V]
    tensor of a 49k vocabulary is most of a step's memory and none of its signal."""
    hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return model.get_output_embeddings()(hidden[mask]).float()


class DistillModule(pl.LightningModule):
    def __init__(self, target_model: Any, loss: Divergence, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, teacher: str = "live", tau_k: int = 4, max_k: int = 8):
        super().__init__()
        if teacher not in TEACHERS:
            raise ValueError(f"distill.teacher={teacher!r}: use one of {TEACHERS}")
        self._target = [target_model.eval().requires_grad_(False)]  # a list: not a submodule (see above)
        self.loss = loss
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.teacher_source, self.tau_k = teacher, tau_k
        self.val_acceptance = AcceptanceMetric(max_k)
        self.val_loss = MeanMetric()  # token-weighted and summed across ranks: exact under uneven shards
        self.val_history: list[dict[str, float]] = []  # one row per validation pass: the acceptance curve
        self._target_memo: dict[str, Any] | None = None  # set by score(): the target's pass over its batch, kept
        self.use_draft_vocab(None)

    @property
    def target(self) -> Any:
        return self._target[0]

    def _place_target(self) -> None:
        if next(self.target.parameters()).device != self.device:
            self._target[0] = self.target.to(self.device)

    def on_fit_start(self) -> None:
        self._place_target()

    def on_validation_start(self) -> None:
        self._place_target()

    # --- what a method provides -------------------------------------------------------------------
    def student_logits(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """[N, V_student] logits at the loss positions."""
        raise NotImplementedError

    # --- a reduced student vocabulary (core/models/vocab.py) ----------------------------------------------
    def use_draft_vocab(self, d2t: torch.Tensor | None) -> None:
        """The student's head scores `d2t`'s target ids only (None: the target's whole vocabulary)."""
        vocab = self.target.get_output_embeddings().weight.shape[0]
        self.vocab_size = vocab
        self.register_buffer("d2t", None if d2t is None else d2t.long())  # saved: a checkpoint knows its head
        self.register_buffer("t2d", None if d2t is None else target_to_draft(d2t.long(), vocab), persistent=False)

    def to_target_vocab(self, student_logits: torch.Tensor) -> torch.Tensor:
        """Student logits over the target's vocabulary (a reduced head scatters; -inf elsewhere): validation
        counts the mass the student cannot propose as lost, exactly as the decoder will."""
        return to_target_logits(student_logits, self.d2t, self.vocab_size)

    def teacher_in_student_vocab(self, teacher: Teacher, targets: torch.Tensor) -> tuple[Teacher, torch.Tensor]:
        """The teacher renormalised over the student's vocabulary (the loss's log_softmax does it), and hard
        targets with -100 where the student cannot emit them."""
        if self.d2t is None:
            return teacher, targets
        targets = torch.where(self.t2d[targets] >= 0, self.t2d[targets], torch.full_like(targets, -100))
        if teacher.topk_ids is not None:  # stored top-k: dense log-probs, ids outside the draft get none
            teacher = Teacher(logits=teacher.log_probs(1.0, self.vocab_size))
        if teacher.logits is not None:
            return Teacher(logits=teacher.logits[:, self.d2t]), targets
        return teacher, targets

    def own_confidence(self, student: torch.Tensor, labels: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """A grid shaped like `where` holding, at its True cells (in the order of `student`'s rows), the student's own
        detached probability of the token that followed, 0 where its draft vocabulary cannot emit it (D-PACE)."""
        _, targets = self.teacher_in_student_vocab(Teacher(), labels)
        q = torch.softmax(student.detach().float(), -1).gather(-1, targets.clamp(min=0)[:, None])[:, 0]
        grid = torch.zeros(where.shape, device=q.device)
        grid[where] = torch.where(targets >= 0, q, torch.zeros_like(q))
        return grid

    def _loss(self, student: torch.Tensor, teacher: Teacher, targets: torch.Tensor,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        teacher, targets = self.teacher_in_student_vocab(teacher, targets)
        # positions the student can learn from: a hard target it can emit, or teacher mass on its vocabulary
        if self.loss.name == "ce":
            valid = targets >= 0
        elif teacher.logits is not None:
            valid = torch.isfinite(teacher.logits).any(-1)
        else:
            valid = torch.ones_like(targets, dtype=torch.bool)
        return (self.loss(student, teacher, mask=valid, targets=targets.clamp(min=0), weights=weights),
                int(valid.sum()))

    def on_policy(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch to train on: a method that samples its own continuations (DistillSpec) swaps them in."""
        return batch

    def student_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # --- shared -----------------------------------------------------------------------------------
    @torch.no_grad()
    def teacher_logits(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        return self.target_pass_once(lambda: logits_at(self.target, batch, mask))

    def target_pass_once(self, compute: Callable[[], Any]) -> Any:
        """`compute()` (a pass of the frozen target), or what it returned the last time when `score()` was given
        the same memo: the target does not change while the student trains, so scoring a batch before and after
        an update needs its pass once."""
        memo = self._target_memo
        if memo is None:
            return compute()
        if "target" not in memo:
            memo["target"] = compute()
        return memo["target"]

    def _bind_memo(self, memo: dict[str, Any] | None, batch: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """`memo`, checked to belong to `batch`: a memo kept for one batch must not score another."""
        if memo is not None and memo.setdefault("batch", batch["input_ids"]) is not batch["input_ids"]:
            raise ValueError("score(): this target_memo holds another batch's target pass; pass a new dict per batch")
        return memo

    def _teacher(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> Teacher:
        if self.loss.name == "ce":
            return Teacher()
        if self.teacher_source == "stored":
            if "topk_ids" not in batch:
                raise ValueError("distill.teacher=stored needs the target's top-k in the generated data: "
                                 "set generate.topk_logprobs > 0 and rerun the generate stage, or use teacher=live")
            return Teacher(topk_ids=batch["topk_ids"][mask], topk_logprobs=batch["topk_logprobs"][mask].float())
        return Teacher(logits=self.teacher_logits(batch, mask))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        batch = self.on_policy(batch)
        mask = batch["loss_mask"]
        loss, n = self._loss(self.student_logits(batch, mask), self._teacher(batch, mask), batch["labels"][mask])
        self.log("train/loss", loss, prog_bar=True, batch_size=max(n, 1))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        mask = batch["loss_mask"]
        t_logits = self.teacher_logits(batch, mask)
        s_logits = self.student_logits(batch, mask)
        loss, n = self._loss(s_logits, Teacher(logits=t_logits), batch["labels"][mask])
        if n:
            self.val_loss.update(loss.detach(), weight=n)
        self.val_acceptance.update(t_logits, self.to_target_vocab(s_logits), mask)

    def on_validation_epoch_end(self) -> None:
        values = self.acceptance_values()  # synced across ranks (sums)
        logged = {"val/loss": self.val_loss.compute(), "val/alpha": values["alpha"], "val/alpha_t0": values["alpha_t0"],
                  "val/tau_sim": values[f"tau_sim{self.tau_k}"], "val/tau_sim_t0": values[f"tau_sim{self.tau_k}_t0"]}
        for key, v in values.items():
            if key.startswith(("alpha_pos", "tau_sim")):
                logged[f"val/{key}"] = v
        logged.update(self.extra_validation_logs())
        self._reset_metrics()
        self.log_validation(logged)

    def log_validation(self, logged: dict[str, Any]) -> None:
        """Log a validation pass's figures (already synced across ranks) and keep them for the curve (val.csv)."""
        self.log_dict({k: torch.as_tensor(v).float() for k, v in logged.items()}, sync_dist=False)
        if not self.trainer.sanity_checking:
            self.val_history.append({"step": self.global_step, **{k: float(v) for k, v in logged.items()}})

    def acceptance_values(self) -> dict[str, torch.Tensor]:
        """Scalar acceptance figures of what validation_step accumulated, `alpha` and `alpha_t0` among them
        (what `score()` returns); a method with its own acceptance metric overrides this."""
        return self.val_acceptance.compute()

    def extra_validation_logs(self) -> dict[str, torch.Tensor]:
        """What a method logs at the end of validation beside loss and acceptance."""
        return {}

    def _reset_metrics(self) -> None:
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()

    @torch.no_grad()
    def score(self, batch: dict[str, torch.Tensor], target_memo: dict[str, Any] | None = None) -> dict[str, float]:
        """The validation acceptance (alpha, alpha_t0, alpha_pos{k}, tau_sim...) of the student on one batch,
        outside a Lightning loop (an online update's gate); the validation metrics are left empty.
        `target_memo`: a dict kept with `batch` by the caller; the target's pass over it runs on the first
        call and is read from the memo on later ones (a new dict for another batch; one for another batch's
        tensors is refused). It holds the target's logits at the scored positions (and a method's hidden
        states) as long as the caller keeps it: memory for time, sized by the batch."""
        training = self.training
        self.eval()
        self._target_memo = self._bind_memo(target_memo, batch)
        try:
            self.validation_step(batch, 0)
        finally:
            self._target_memo = None
        values = {k: float(v) for k, v in self.acceptance_values().items()}
        self._reset_metrics()
        self.train(training)
        return values

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["val_history"] = self.val_history  # a resumed run continues the curve

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.val_history = list(checkpoint.get("val_history", []))

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.student_parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer, num_training_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@torch.no_grad()
def features_and_teacher(module: DistillModule, batch: dict[str, torch.Tensor], layers: list[int],
                         stored: list[int] | None, hidden_size: int) -> tuple[torch.Tensor, Teacher]:
    """(the target's fused features [B, T, F] at `layers`, the target at the scored positions) for a head on the
    frozen target's states (EAGLE, DFlash): from the features stage's store when the batch carries it (`stored`:
    where `layers` sit among the stored ones; no target pass), else from the frozen target, live."""
    from specdistill.core.models.hidden import HiddenTap

    mask = batch["loss_mask"]
    if "features" in batch and stored is not None:
        b, t, _ = batch["features"].shape
        features = batch["features"].view(b, t, -1, hidden_size)[:, :, stored].flatten(2)
        return features, Teacher(topk_ids=batch["topk_ids"][mask], topk_logprobs=batch["topk_logprobs"][mask])

    def live() -> tuple[torch.Tensor, Teacher]:
        target = module.target
        with HiddenTap(target, list(layers)) as tap:
            hidden = target.get_decoder()(input_ids=batch["input_ids"],
                                          attention_mask=batch["attention_mask"]).last_hidden_state
        return tap.concat(), Teacher(logits=target.get_output_embeddings()(hidden[mask]).float())

    return module.target_pass_once(live)
