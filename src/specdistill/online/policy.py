"""When to update the draft while serving, and when to stop (conf/online/)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class OnlineConfig:
    method: str = "draft"  # draft (models/draft) | eagle (models/eagle)
    scenario: str = "code"  # code: a ShareGPT-distilled draft serves HumanEval | chat: held-out ShareGPT prompts
    # method -> the offline draft it starts from (dvc.yaml makes an online@<method> item per key)
    items: dict = field(default_factory=lambda: {"draft": "models/draft", "eagle": "models/eagle"})
    requests: int = 48  # the stream served while learning
    held_out: int = 16  # requests measured afterwards by the frozen and the online draft
    max_new_tokens: int = 48
    temperature: float = 0.0
    k: int = 2  # draft chain length (method=draft)
    decode: dict = field(default_factory=dict)  # method -> keys over its decode.<method> while serving
    update_every: int = 8  # requests between updates ...
    min_rejected: int = 0  # ... or as soon as the buffer holds this many rejected positions (0: off)
    steps: int = 4  # optimizer steps per update
    batch_size: int = 4  # requests per step
    lr: float = 1e-4
    loss: str = "fkl"  # divergence against the target's stored top-k (fkl | topk_kl | ce)
    topk: int = 256  # target log-probs kept per judged position
    replay_accepted: float = 0.25  # fraction of accepted positions trained on beside every rejected one
    replay_offline: float = 0.0  # fraction of update steps on a batch of the offline training data (live teacher)
    buffer_tokens: int = 32_768  # buffer size (tokens of the kept requests)
    window: int = 16  # requests in the moving acceptance window
    patience: int = 3  # updates without a gain of `epsilon` in the window before updating stops
    epsilon: float = 0.005
    rearm: float = 0.1  # updating resumes once a full window falls this far below the best one (0: never)
    gate: int = 0  # newest requests kept out of each update to check it on: the update is deployed only if ...
    gate_tolerance: float = 0.0  # ... the draft's acceptance there falls by at most this, else it is rolled back
    save_every: int = 1  # keep every N-th deployed version (safetensors, with its request count)
    seed: int = 0
    engine: dict = field(default_factory=dict)  # online_engine@<m>: how vLLM serves (online/engine.py EngineServing)
    RANGES: ClassVar[dict[str, str]] = {  # checked by `section` at the stage's start, with the key named
        "requests": "[1, inf)", "held_out": "[1, inf)", "max_new_tokens": "[1, inf)", "temperature": "[0, 2]",
        "k": "[1, 64]", "update_every": "[1, inf)", "min_rejected": "[0, inf)", "steps": "[1, inf)",
        "batch_size": "[1, inf)", "lr": "(0, inf)", "topk": "[1, inf)", "replay_accepted": "[0, inf)",
        "replay_offline": "[0, 1]", "buffer_tokens": "[1, inf)", "window": "[1, inf)", "patience": "[1, inf)",
        "epsilon": "[0, inf)", "rearm": "[0, 1]", "gate": "[0, inf)", "gate_tolerance": "[0, 1]",
        "save_every": "[1, inf)"}

    def __post_init__(self) -> None:
        from specdistill import methods

        methods.get(self.method, "online", "online.method")
        if self.method not in self.items:
            raise ValueError(f"online.method={self.method!r}: give its offline draft as online.items.{self.method} "
                             f"or use one of {sorted(self.items)}")
        if self.scenario not in ("code", "chat"):
            raise ValueError(f"online.scenario={self.scenario!r}: use code or chat")
        if min(self.requests, self.update_every, self.steps, self.batch_size, self.window, self.patience) < 1:
            raise ValueError("online requests, update_every, steps, batch_size, window and patience must be >= 1")
        if self.gate < 0 or self.gate_tolerance < 0:
            raise ValueError(f"online.gate={self.gate} and online.gate_tolerance={self.gate_tolerance} must be >= 0 "
                             "(gate 0: every update is deployed unchecked)")
        if self.gate >= self.update_every:
            raise ValueError(f"online.gate={self.gate} must be below online.update_every={self.update_every}: "
                             "an update trains on the requests before its gate")
        if self.rearm < 0:
            raise ValueError(f"online.rearm={self.rearm} must be >= 0 (0: never resume after stopping)")
        for key in ("replay_accepted", "replay_offline"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"online.{key}={getattr(self, key)} must be in [0, 1]")


class StoppingRule:
    """Stop updating once `patience` updates in a row have not raised the moving-window acceptance by
    `epsilon` over the best window seen: the draft has learnt what this traffic teaches. Re-arm once the
    window falls `rearm` below that best: the traffic has moved on (a new kind of request), so learn again."""

    def __init__(self, window: int, patience: int, epsilon: float, rearm: float = 0.0):
        self.rates: deque[float] = deque(maxlen=window)
        self.patience, self.epsilon, self.rearm = patience, epsilon, rearm
        self.best = float("-inf")
        self.stale = 0
        self.stopped = False
        self.rearmed = 0  # times updating resumed after a stop
        self.since_stop = 0  # requests observed since the last stop

    def observe(self, rate: float) -> None:
        self.rates.append(rate)
        self.since_stop += self.stopped

    @property
    def current(self) -> float:
        return sum(self.rates) / len(self.rates) if self.rates else 0.0

    def should_update(self) -> bool:
        """Called when an update is due; False while stopped."""
        if self.stopped:
            if not (self.rearm > 0 and self.since_stop >= self.rates.maxlen and self.current < self.best - self.rearm):
                return False
            # a full window of requests since the stop sits well below the best: start over from its level
            self.stopped, self.stale, self.best, self.since_stop = False, 0, self.current, 0
            self.rearmed += 1
            return True
        if self.current > self.best + self.epsilon:
            self.best, self.stale = self.current, 0
        else:
            self.stale += 1
            self.stopped = self.stale >= self.patience
        return not self.stopped
