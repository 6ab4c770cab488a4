"""The benchmark: every method on the same prompts, in the same process, in interleaved order.

Methods: `ar` (our loop with no draft: the baseline every speed-up divides by), `hf_generate`
(transformers' own decoding), `spec` (our decoder with the draft under test), `hf_assisted`
(transformers' assisted generation with the same draft, the same K, a constant schedule) and `lookup`
(prompt lookup, training-free). The order of methods rotates from prompt to prompt, so drift of the
machine's speed does not favour one. MT-bench's second turn follows each method's own first answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import Proposer, SamplingConfig
from specdistill.decoding.verifier import TargetVerifier
from specdistill.evaluation.accounting import Tally
from specdistill.evaluation.prompts import Conversation  # noqa: F401 (its runs take them)

log = logging.getLogger(__name__)


@dataclass
class Method:
    name: str
    generate: Callable[[list[int], SamplingConfig, torch.Generator], tuple[list[int], dict[str, Any]]]


def our_method(name: str, model: Any, proposer: Proposer | None, max_new_tokens: int, stops: set[int],
               capacity: int, max_pos: int) -> Method:
    verifier = TargetVerifier(model, capacity, getattr(proposer, "feature_layers", ()))

    def run(prompt: list[int], sampling: SamplingConfig, g: torch.Generator):
        res = speculative_generate(verifier, proposer, prompt, max_new_tokens, stops, sampling, g)
        attempts, accepts = res.acceptance_counts(max_pos)
        alpha_exact, kl = res.first_position()
        return res.tokens, {"forwards": res.target_forwards, "attempts": attempts, "accepts": accepts,
                            "alpha_exact": alpha_exact, "kl": kl,
                            "draft_s": sum(r.draft_s for r in res.rounds),
                            "verify_s": sum(r.verify_s for r in res.rounds) + res.prefill_s}

    return Method(name, run)


def hf_method(name: str, model: Any, max_new_tokens: int, stops: set[int], pad_id: int,
              assistant: Any = None, k: int = 4) -> Method:
    extra: dict[str, Any] = {}
    if assistant is not None:
        extra = {"assistant_model": assistant, "num_assistant_tokens": k,
                 "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}

    @torch.inference_mode()
    def run(prompt: list[int], sampling: SamplingConfig, g: torch.Generator):
        ids = torch.tensor([prompt], device=next(model.parameters()).device)
        kw: dict[str, Any] = {"do_sample": not sampling.greedy, "max_new_tokens": max_new_tokens,
                              "eos_token_id": sorted(stops), "pad_token_id": pad_id, **extra}
        if not sampling.greedy:
            kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        return out[0, len(prompt):].tolist(), {}

    return Method(name, run)


@dataclass
class Results:
    tallies: dict[tuple[str, str, str], Tally] = field(default_factory=dict)  # (dataset, temp, method)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def tally(self, dataset: str, temp: str, method: str) -> Tally:
        return self.tallies.setdefault((dataset, temp, method), Tally())


def run_benchmark(methods: list[Method], datasets: dict[str, list[Conversation]], temperatures: list[float],
                  top_p: float, top_k: int, encode: Callable[[list[dict[str, str]]], list[int]],
                  decode: Callable[[list[int]], str], seed: int = 0) -> Results:
    results = Results()
    total = sum(len(c.turns) for convs in datasets.values() for c in convs) * len(temperatures) * len(methods)
    bar = tqdm(total=total, desc="evaluate", unit="gen", dynamic_ncols=True)
    turn_no = 0
    for temperature in temperatures:
        sampling = SamplingConfig(temperature, top_p if temperature > 0 else 1.0, top_k if temperature > 0 else 0)
        temp = f"T{temperature:g}"
        for dataset, convs in datasets.items():
            for c_idx, conv in enumerate(convs):
                history: dict[str, list[dict[str, str]]] = {m.name: [] for m in methods}
                for t_idx, turn in enumerate(conv.turns):
                    order = methods[turn_no % len(methods):] + methods[: turn_no % len(methods)]
                    turn_no += 1
                    for m in order:
                        messages = history[m.name] + [{"role": "user", "content": turn}]
                        prompt = encode(messages)
                        g = torch.Generator().manual_seed(seed * 1_000_003 + c_idx * 101 + t_idx)
                        t0 = time.perf_counter()
                        tokens, extra = m.generate(prompt, sampling, g)
                        seconds = time.perf_counter() - t0
                        results.tally(dataset, temp, m.name).add(len(tokens), seconds, **extra)
                        text = decode(tokens)
                        history[m.name] = messages + [{"role": "assistant", "content": text}]
                        results.samples.append({"dataset": dataset, "temperature": temperature, "id": conv.id,
                                                "turn": t_idx + 1, "method": m.name, "tokens": len(tokens),
                                                "seconds": round(seconds, 3), "text": text[:2000]})
                        bar.update(1)
                        bar.set_postfix(set=f"{dataset}/{temp}", method=m.name)
    bar.close()
    return results
