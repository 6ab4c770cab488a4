"""The serving loop: answer each request with the speculative decoder (batch size 1), keep what the
verifier judged, and keep distilling the draft on its rejections while it serves.

The optimizer steps run through Lightning Fabric on the same Lightning module that trained the draft
offline (`methods/draft/training.py`, `methods/eagle/training.py`), so the update uses the offline loss code:
the separate draft learns from the target's stored top-k at the judged positions (no target
forward), an EAGLE head from a live target pass over the buffered requests (it needs their states).
The student trains in float32 and is deployed into the serving copy (the target's dtype) after each
update: the updated draft serves the next request; every `save_every`-th deployed version is saved.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.online.buffer import RejectionBuffer
from specdistill.online.policy import OnlineConfig, StoppingRule
from specdistill.online.recorder import RecordingVerifier, RequestRecord

log = logging.getLogger(__name__)


@dataclass
class Served:
    """One request's outcome, one row of the curve."""

    request: int
    tokens: int
    rounds: int
    accepted: int
    judged: int
    tau: float
    seconds: float
    version: int  # updates applied before this request

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.judged if self.judged else 0.0


@dataclass
class Update:
    request: int  # after this many requests
    seconds: float
    loss: float
    positions: int
    buffer_requests: int
    buffer_rejected: int
    gate_before: float | None = None  # the draft's acceptance on the gate requests before the update (online.gate)
    gate_after: float | None = None  # ... and after it
    deployed: bool = True  # False: the gate rolled it back
    started: float = 0.0  # wall-clock time (time.time()) the update began: the engine's throughput meanwhile


@dataclass
class OnlineLog:
    served: list[Served] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)
    stopped_at: int | None = None  # requests served when updating first stopped
    resumed_at: list[int] = field(default_factory=list)  # ... and whenever it re-armed (StoppingRule.rearm)


class OnlineDistiller:
    """Serves requests with `proposer` against `verifier`, updating `module`'s student in place."""

    def __init__(self, module: Any, proposer: Any, verifier: Any, cfg: OnlineConfig, stops: set[int], pad_id: int,
                 learn: bool = True, deploy: Callable[[], None] | None = None,
                 save: Callable[[Path, int], None] | None = None, save_dir: Path | None = None,
                 offline: Iterator[dict[str, torch.Tensor]] | None = None, offline_module: Any = None):
        from lightning.fabric import Fabric

        self.cfg, self.stops, self.pad_id, self.learn = cfg, stops, pad_id, learn
        self.proposer = proposer
        self.verifier = RecordingVerifier(verifier, topk=cfg.topk)
        self.buffer = RejectionBuffer(cfg.buffer_tokens)
        self.rule = StoppingRule(cfg.window, cfg.patience, cfg.epsilon, cfg.rearm)
        self.sampling = SamplingConfig(cfg.temperature)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.log = OnlineLog()
        self.save, self.save_dir = save, save_dir
        self.deploy = deploy  # copies the trained (float32) weights into the serving copy
        # replay of the offline training data (so the draft does not forget it): batches of the generate
        # stage's answers through a module with a live teacher that shares the student
        self.offline, self.offline_module = offline, offline_module or module
        if cfg.replay_offline > 0 and offline is None:
            raise ValueError("online.replay_offline > 0 needs the offline training batches")
        self.version = 0
        self.module = module
        if learn:
            self.fabric = Fabric(accelerator="cpu" if module.device.type == "cpu" else "auto", devices=1)
            self.params = params = module.student_parameters()
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
            # Fabric routes the module's self.log calls and owns backward (precision, devices); the module is the
            # offline one, so its training_step is the offline loss
            _, self.optimizer = self.fabric.setup(module, self.optimizer, move_to_device=False)
        self._since_update = 0
        self._rated_since_update = 0  # requests since the last update that judged the deployed draft alone

    def serve(self, prompt: list[int]) -> tuple[list[int], RequestRecord]:
        t0 = time.perf_counter()
        self.verifier.keep_topk = self.learn  # the top-k of the target's rows is the teacher: only when learning
        res = speculative_generate(self.verifier, self.proposer, prompt, self.cfg.max_new_tokens, self.stops,
                                   self.sampling, self.generator)
        seconds = time.perf_counter() - t0
        record = self.verifier.record.finish(res.tokens)
        self.observe(record, Served(len(self.log.served), len(res.tokens), len(res.rounds), record.num_accepted,
                                    len(record.accepted), res.tau, seconds, self.version), record.acceptance_rate)
        return res.tokens, record

    def observe(self, record: RequestRecord, served: Served, rate: float | None) -> None:
        """One served request, whoever served it (our decoder here, the engine in `online/engine.py`): into the
        curve, the stopping rule and, when learning, the buffer; an update when one is due. `rate`: the acceptance
        the stopping rule counts for the deployed draft (None: the request does not judge that draft alone, e.g.
        the engine served part of it with the version before). An update waits for one such request at least, so
        the rule never judges a version on none of its own requests."""
        self.log.served.append(served)
        if rate is not None:
            self.rule.observe(rate)
            self._rated_since_update += 1
        if not self.learn:
            return
        self.buffer.add(record)
        self._since_update += 1
        stopped = self.rule.stopped
        if self._due() and self._rated_since_update and self.rule.should_update():
            if stopped:
                self.log.resumed_at.append(len(self.log.served))
                log.info("online: the acceptance window fell to %.3f, more than %.3f below its best: updating "
                         "again after %d requests", self.rule.current, self.cfg.rearm, len(self.log.served))
            self.update()
        elif self.rule.stopped and self.log.stopped_at is None:
            self.log.stopped_at = len(self.log.served)
            log.info("online: acceptance has not improved for %d updates, stopped updating after %d requests",
                     self.cfg.patience, self.log.stopped_at)

    def _due(self) -> bool:
        by_count = self._since_update >= self.cfg.update_every
        by_rejections = self.cfg.min_rejected > 0 and self.buffer.rejected >= self.cfg.min_rejected
        return by_count or by_rejections

    def update(self) -> Update | None:
        """A few optimizer steps on buffered batches; the next request is served by the updated draft.
        With `online.gate`, the newest requests are kept out of the steps and the draft's acceptance on them
        (against a live target pass) is measured before and after: an update that lowers it by more than
        `gate_tolerance` is undone (weights and optimizer state) and the deployed draft stays."""
        self._since_update = self._rated_since_update = 0
        t0, started = time.perf_counter(), time.time()
        gate = self.buffer.newest(self.cfg.gate, self.pad_id) if self.cfg.gate else None
        if gate is not None:
            gate = {k: v.to(self.module.device) for k, v in gate.items()}
            memo: dict[str, Any] = {}  # the target's pass over the gate requests, run once for both scores
            before = self._gate_score(gate, memo)
            snapshot = [p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict())
        losses, positions = [], 0
        self.module.train()
        for _ in range(self.cfg.steps):
            module = self.module
            if self.offline is not None and float(torch.rand((), generator=self.generator)) < self.cfg.replay_offline:
                batch, module = next(self.offline), self.offline_module
            else:
                batch = self.buffer.batch(self.cfg.batch_size, self.cfg.replay_accepted, self.pad_id, self.generator,
                                          skip_newest=self.cfg.gate if gate is not None else 0)
            if batch is None:
                continue
            batch = {k: v.to(self.module.device) for k, v in batch.items()}
            loss = module.training_step(batch, 0)
            self.optimizer.zero_grad()
            self.fabric.backward(loss)
            self.optimizer.step()
            losses.append(float(loss.detach()))
            positions += int(batch["loss_mask"].sum())  # offline replay positions included
        self.module.eval()
        if not losses:
            return None
        gate_scores, deployed = (None, None), True
        if gate is not None:
            gate_scores = before, self._gate_score(gate, memo)
            deployed = gate_scores[1] >= before - self.cfg.gate_tolerance
            if not deployed:  # undo: the student and the optimizer as the deployed draft left them
                with torch.no_grad():
                    for p, kept in zip(self.params, snapshot[0], strict=True):
                        p.copy_(kept)
                self.optimizer.load_state_dict(snapshot[1])
        if deployed:
            self.version += 1
            if self.deploy is not None:
                self.deploy()  # the proposer's caches are rebuilt at the next request (the loop resets it)
        up = Update(len(self.log.served), time.perf_counter() - t0, sum(losses) / len(losses), positions,
                    len(self.buffer), self.buffer.rejected, *gate_scores, deployed, started)
        self.log.updates.append(up)
        if deployed and self.save is not None and self.save_dir is not None and self.version % self.cfg.save_every == 0:
            self.save(self.save_dir / f"v{self.version:03d}-r{up.request:04d}", up.request)
        log.info("online update after %d requests: loss %.4f on %d positions, %.1f s; %s%s", up.request, up.loss,
                 positions, up.seconds,
                 "" if gate is None else f"gate acceptance {before:.3f} -> {up.gate_after:.3f}: ",
                 f"deployed as version {self.version}" if deployed else "rolled back")
        return up

    def _gate_score(self, batch: dict[str, torch.Tensor], memo: dict[str, Any]) -> float:
        """Teacher-forced acceptance on the gate batch at the serving temperature (greedy agreement at T=0)."""
        values = self.module.score(batch, memo)
        return values["alpha_t0" if self.cfg.temperature == 0 else "alpha"]
