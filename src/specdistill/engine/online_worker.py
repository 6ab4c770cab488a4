"""Runs INSIDE the engine's virtualenv, imported by worker.py: vLLM serves a stream while its drafter learns.

Online speculative distillation with the engine as the server (the trainer is specdistill's stage, in its own
process; `specdistill.online.engine` is its side). They share a folder, the channel:

- `requests.jsonl`, appended here as each request finishes (one JSON line, flushed): its phase, index, output
  tokens, the tokens each engine step emitted for it (a decode step emits its accepted drafts + 1: where the draft
  was right and where it was first wrong), the weight version of each of those steps, and in a learning phase the
  target's top-k log-probs at every output position (the request's own logprobs: under speculation vLLM takes
  them from the target's verification pass);
- `CURRENT.json`, written by the trainer (atomically, after the weights file it names is whole): the version to
  serve, its safetensors file, and `final` once the trainer has learnt from every request of the learning phase.

Between two engine steps this side checks CURRENT.json and, when it names a newer version, loads those weights
into the running drafter in place (`collective_rpc` -> vLLM's `reload_weights`); requests in flight keep going
(the target verifies every draft token, so a new drafter changes no output law). A phase marked `after_final`
starts once the trainer says it is done, so it measures the draft as the stream left it.

No import of specdistill here (its environment pins another transformers).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

CURRENT = "CURRENT.json"
REQUESTS = "requests.jsonl"


class Drafter:
    """The running engine's drafter weights: which version serves, and loading a newer one when the trainer asks."""

    def __init__(self, llm: Any, channel: Path):
        self.llm, self.current = llm, channel / CURRENT
        self.version, self.final, self._seen = 0, False, None
        self.swaps: list[dict[str, Any]] = []

    def poll(self) -> None:
        """Load the version CURRENT.json names if it is newer than the one serving (a stat per engine step)."""
        try:
            stamp = self.current.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if stamp == self._seen:
            return
        self._seen = stamp
        want = json.loads(self.current.read_text())
        self.final = bool(want.get("final"))
        if int(want["version"]) > self.version:
            t0 = time.perf_counter()
            load_drafter(self.llm, self.current.parent / want["file"])
            self.version = int(want["version"])
            self.swaps.append({"version": self.version, "t": time.time(), "seconds": time.perf_counter() - t0})
            print(f"[engine] drafter version {self.version} loaded", file=sys.stderr, flush=True)

    def wait_final(self, timeout_s: float, check_parent: Any) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.final:
            check_parent()
            if time.monotonic() > deadline:
                raise SystemExit(f"the trainer did not finish learning within {timeout_s:.0f} s of the stream's end")
            time.sleep(0.05)
            self.poll()


def load_drafter(llm: Any, weights_file: Path) -> None:
    """The drafter's weights replaced in place by a safetensors file in the checkpoint's own names. A plain copy_
    into the parameters is not enough: on a CPU vLLM keeps linear weights prepacked for oneDNN, and
    `reload_weights` runs the model's own loaders and post-processing again. What the file leaves out (the
    embeddings, which a drafter may share with the target) stays as it is."""
    from safetensors.torch import load_file

    weights = load_file(str(weights_file))

    def swap(worker: Any) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        runner = worker.model_runner
        with set_current_vllm_config(runner.vllm_config):
            reload_weights(runner.vllm_config, runner.drafter.model, weights_iterator=iter(weights.items()),
                           weights_path=None, is_checkpoint_format=True)

    llm.collective_rpc(swap)


def top_logprobs(position: dict[int, Any], k: int) -> tuple[list[int], list[float]]:
    """The target's k most likely tokens at one output position (vLLM adds the sampled token when outside them)."""
    ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in position.items() if lp.rank <= k))
    return [tok for _, tok, _ in ranked], [lp for _, _, lp in ranked]


def serve_online(llm: Any, job: dict[str, Any], check_parent: Any) -> dict[str, Any]:
    """Every phase of the job in turn on this one engine; the drafter swapped between steps as the trainer asks.
    A phase may set its own temperature, max_tokens, concurrency and ignore_eos over the job's."""
    from vllm import SamplingParams

    spec = job["online"]
    channel = Path(spec["channel"])
    drafter = Drafter(llm, channel)
    engine = llm.llm_engine
    steps_log: list[list[float]] = []  # [time, tokens emitted] per engine step of a learning phase: throughput
    with open(channel / REQUESTS, "a") as out:
        for phase in spec["phases"]:
            name, prompts, topk = phase["name"], phase["prompts"], int(phase.get("logprobs", 0))
            if phase.get("after_final"):
                drafter.wait_final(float(spec.get("wait_s", 3600)), check_parent)
            pending = list(range(len(prompts)))
            live: dict[str, dict[str, Any]] = {}

            def submit(i: int, name: str = name, prompts: list = prompts, topk: int = topk,
                       live: dict = live, phase: dict = phase) -> None:
                params = SamplingParams(temperature=float(phase.get("temperature", spec["temperature"])),
                                        max_tokens=int(phase.get("max_tokens", spec["max_tokens"])),
                                        seed=int(spec.get("seed", 0)) + i, stop_token_ids=spec.get("stop_token_ids"),
                                        logprobs=topk or None, ignore_eos=bool(phase.get("ignore_eos", False)))
                rid = f"{name}-{i}"
                live[rid] = {"phase": name, "index": i, "steps": [], "versions": [], "emitted": 0,
                             "t_start": time.time()}
                engine.add_request(rid, {"prompt_token_ids": list(prompts[i])}, params)

            concurrency = int(phase.get("concurrency", spec.get("concurrency", 1)))
            while pending and len(live) < concurrency:
                submit(pending.pop(0))
            done = 0
            while engine.has_unfinished_requests():
                check_parent()
                drafter.poll()
                t0 = time.perf_counter()
                outputs = engine.step()
                emitted = 0
                for o in outputs:
                    row, comp = live[o.request_id], o.outputs[0]
                    n = len(comp.token_ids) - row["emitted"]  # the output is cumulative: this step's tokens
                    if n > 0:
                        row["emitted"] += n
                        row["steps"].append(n)
                        row["versions"].append(drafter.version)
                        emitted += n
                    if not o.finished:
                        continue
                    row.update(token_ids=list(comp.token_ids), finish_reason=comp.finish_reason,
                               seconds=time.time() - row["t_start"], t_end=time.time())
                    if topk:
                        tops = [top_logprobs(p, topk) for p in comp.logprobs]
                        row["topk_ids"], row["topk_logprobs"] = [t[0] for t in tops], [t[1] for t in tops]
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    del live[o.request_id]
                    done += 1
                    if pending:
                        submit(pending.pop(0))
                    print(f"[engine] {name}: {done}/{len(prompts)} requests, drafter version {drafter.version}",
                          file=sys.stderr, flush=True)
                if phase.get("learn"):
                    steps_log.append([time.time(), emitted, time.perf_counter() - t0])
    return {"swaps": drafter.swaps, "steps": steps_log, "final_version": drafter.version}
