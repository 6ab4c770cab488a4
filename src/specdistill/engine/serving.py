"""What the serve stage asks the engine and how it reads the answers: jobs, and acceptance and speed from them.

One engine start per setting of the engine (no speculation, then each K), each serving every dataset x
temperature x concurrency run. Definitions are docs/definitions.md's, from the engine's own counters: a "draft" is one
round of K drafted tokens; `per_pos[i]` counts rounds whose first i+1 tokens were accepted, so alpha_pos{i+1} =
per_pos[i] / per_pos[i-1] (conditional, as ours), tau = 1 + accepted / drafts (tokens per target forward), and
the speed-up is output tokens/s against the engine without speculation on the same requests.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

from specdistill import methods
from specdistill.core.errors import ConfigError
from specdistill.evaluation.prompts import check_eval_sets

ABOVE_TAU = 1.1  # a speed-up above this times tau is flagged (noise allowance: tau is itself a sample mean)
AR_LAST = "ar_last"  # the engine alone again after the K starts (serve.ar_bracket)
MAX_DRIFT = 0.1  # the two baselines of a run further apart than this (relative) are flagged


@dataclass
class ServeConfig:
    method: str
    datasets: list[str]
    num_prompts: int
    split: str
    max_new_tokens: int
    temperatures: list[float]
    concurrency: list[int]
    k: list[int]
    agreement_k: int
    dtype: str | None
    threads: str | None
    iomp: bool
    multiprocessing: bool  # vLLM's engine core in a process of its own (vLLM's default) or in the worker's
    max_model_len: int | None
    ngram_max: int
    ngram_min: int
    export_dir: str
    # serve@<key>: `method`, the registered method it serves; `engine`, the export the engine loads beside the target;
    # `ours`, what our decoder reads to draft the same chain (the agreement table; `agreement: false` skips it).
    # dvc.yaml makes one item per key.
    items: dict[str, dict[str, str]]
    timeout_s: int
    seed: int
    deploy_min_speedup: float  # a load's K goes into the deployed schedule only at this speed-up or more (else 0)
    ar_bracket: bool  # the engine alone also after the K starts: each baseline the mean of the two
    skip_idle_drafter: bool  # the deployed schedule runs no drafter forward at its K = 0 loads (engine-plugin/)
    RANGES: ClassVar[dict[str, str]] = {  # checked by `section` at the stage's start, with the key named
        "deploy_min_speedup": "[0, inf)", "num_prompts": "[1, inf)", "max_new_tokens": "[1, inf)",
        "timeout_s": "[1, inf)", "temperatures": "[0, 2]",
        "concurrency": "[1, 256]", "k": "[1, 256]", "max_model_len": "[64, inf)", "ngram_max": "[1, inf)",
        "ngram_min": "[1, inf)"}

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, value: Any, rule: str) -> None:
            if not ok:
                raise ConfigError(f"serve.{key}={value!r}: {rule}")

        need(self.method in self.items, "method", self.method, f"give serve.items.{self.method} (method, engine, "
             f"ours) or use one of {sorted(self.items)}")
        for key, item in self.items.items():
            need({"method", "engine", "ours"} <= set(item) <= {"method", "engine", "ours", "agreement"},
                 f"items.{key}", item, "a map with keys method (the registered method), engine and ours (and "
                 "agreement: false where our decoder does not read the draft)")
        methods.get(self.registered, "serve", f"serve.items.{self.method}.method")
        check_eval_sets(self.datasets, "serve.datasets")
        for key in ("temperatures", "concurrency", "k"):  # types and ranges: `section`; here what it cannot say
            need(bool(getattr(self, key)), key, getattr(self, key), "a non-empty list")
        need(self.agreement_k in self.k, "agreement_k", self.agreement_k, f"one of serve.k={self.k}")
        need(1 <= self.ngram_min <= self.ngram_max, "ngram_min", self.ngram_min, "in [1, serve.ngram_max]")
        need(self.dtype in (None, "float32", "bfloat16"), "dtype", self.dtype, "float32, bfloat16 or null")

    @property
    def registered(self) -> str:
        """The registered method this item serves (its key may name a variant: a reference trainer's draft)."""
        return self.items[self.method]["method"]

    @property
    def models(self) -> dict[str, str]:
        """method -> the folder our decoder reads (what a method's `agreement_proposer` finds by `trained_folder`):
        this item's."""
        return {self.registered: self.items[self.method]["ours"]}


def prompt_requests(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The requests of one run: the prompts in turn, at least twice the concurrency so the engine reaches it."""
    n = max(len(prompts), 2 * concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def speculative_config(cfg: ServeConfig, k: int, draft_dir: str | None) -> dict[str, Any]:
    """vLLM's `speculative_config` for the method at K drafted tokens (the method's `engine` part)."""
    method = methods.get(cfg.registered, "serve", f"serve.items.{cfg.method}.method")
    return method.speculative_config(cfg, k, draft_dir)


def job(cfg: ServeConfig, target_dir: str, prompts: dict[str, list[list[int]]], stops: list[int], dtype: str,
        spec: dict[str, Any] | None, max_model_len: int) -> dict[str, Any]:
    runs = [{"name": f"{ds}|{t}|{c}", "concurrency": c, "temperature": t, "max_tokens": cfg.max_new_tokens,
             "prompts": prompt_requests(p, c), "stop_token_ids": stops, "seed": cfg.seed}
            for ds, p in prompts.items() for t in cfg.temperatures for c in cfg.concurrency]
    return {"target": target_dir, "dtype": dtype, "max_model_len": max_model_len, "seed": cfg.seed,
            "speculative_config": spec, "runs": runs}


def acceptance(spec: dict[str, Any]) -> dict[str, Any]:
    """tau and alpha per position from the engine's counters (None without drafts)."""
    drafts = spec["vllm:spec_decode_num_drafts"]
    per_pos = spec["vllm:spec_decode_num_accepted_tokens_per_pos"]
    if not drafts:
        return {"drafts": 0}
    out: dict[str, Any] = {"drafts": drafts, "accepted_per_pos": per_pos,
                           "tau": round(1 + spec["vllm:spec_decode_num_accepted_tokens"] / drafts, 4)}
    prev = drafts
    for i, n in enumerate(per_pos):
        out[f"alpha_pos{i + 1}"] = round(n / prev, 4) if prev else None
        prev = n
    return out


def engine_counts(rounds: list[Any], max_new_tokens: int, k: int) -> tuple[int, int, list[int]]:
    """(drafts, accepted, accepted prefixes per position) of our decoder's rounds, counted as the engine counts:
    every round that starts before max_new_tokens and proposes something (the engine drafts all K in a request's
    last round, where our loop shortens the chain to what fits, so run ours K + 1 tokens further)."""
    drafts, accepted, per_pos, emitted = 0, 0, [0] * k, 1  # the prefill's token
    for r in rounds:
        if emitted >= max_new_tokens:
            break
        emitted += r.emitted
        if not r.draft_len:  # no proposal (lookup found no match): the engine counts no draft either
            continue
        drafts += 1
        accepted += r.accepted
        for i in range(r.accepted):
            per_pos[i] += 1
    return drafts, accepted, per_pos


def speed(run: dict[str, Any]) -> dict[str, Any]:
    lat = sorted(r["latency_s"] for r in run["requests"])
    return {"requests": len(lat), "output_tokens": run["output_tokens"], "wall_s": round(run["wall_s"], 3),
            "tokens_per_s": round(run["output_tokens"] / run["wall_s"], 2),
            "latency_p50_s": round(statistics.median(lat), 3),
            "latency_p90_s": round(lat[min(len(lat) - 1, int(0.9 * len(lat)))], 3)}


def summarise(cfg: ServeConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{dataset: {T: {c: {"ar": speed, "k<K>": speed + acceptance + speedup}}}} and the K chosen per concurrency.

    `results` maps "ar" and "k<K>" to the engine's result for that start."""
    table: dict[str, Any] = {}
    for setting, res in results.items():
        if setting == AR_LAST:
            continue
        for run in res["runs"]:
            ds, t, c = run["name"].split("|")
            row = speed(run)
            if setting != "ar":
                row.update(acceptance(run["spec"]))
            table.setdefault(ds, {}).setdefault(f"T{float(t)}", {}).setdefault(f"c{c}", {})[setting] = row
    drift = bracket_baseline(table, results[AR_LAST]) if AR_LAST in results else []
    above_tau = []
    for ds_name, ds in table.items():
        for t, temps in ds.items():
            for c, cell in temps.items():
                ar = cell["ar"]["tokens_per_s"]
                for setting, row in cell.items():
                    if setting != "ar":
                        row["speedup"] = round(row["tokens_per_s"] / ar, 4)
                        # every step costs at least a target forward and yields tau tokens on average: a
                        # speed-up clearly above tau means the engine alone ran slow in its start
                        if row.get("tau") and row["speedup"] > ABOVE_TAU * row["tau"]:
                            above_tau.append(f"{ds_name}|{t}|{c}|{setting}")
    chosen = {}
    for c in cfg.concurrency:  # the K with the best geometric-mean speed-up over datasets and temperatures
        def score(k: int, c: int = c) -> float:
            xs = [temps[f"c{c}"][f"k{k}"]["speedup"] for ds in table.values() for temps in ds.values()]
            return statistics.geometric_mean(xs)
        best = max(cfg.k, key=score)
        # deploy_k: what to serve at this load; 0 (no speculation) where no K beats the engine alone
        chosen[f"c{c}"] = {"k": best, "speedup_geomean": round(score(best), 4),
                           "deploy_k": best if score(best) >= cfg.deploy_min_speedup else 0}
    return {"results": table, "chosen_k": chosen, "above_tau": above_tau, "baseline_drift": drift}


def bracket_baseline(table: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """The engine alone measured at both ends of the K starts (serve.ar_bracket): each run's baseline becomes the mean
    of the two, so a machine that slowed or sped up during the stage moves the baseline with it; both are kept, and
    the runs whose two measurements differ by more than MAX_DRIFT are returned (a busy machine: rerun quietly)."""
    drifted = []
    for run in last["runs"]:
        ds, t, c = run["name"].split("|")
        row = table[ds][f"T{float(t)}"][f"c{c}"]["ar"]
        first, second = row["tokens_per_s"], speed(run)["tokens_per_s"]
        mean = (first + second) / 2
        row.update(tokens_per_s=round(mean, 2), tokens_per_s_first=first, tokens_per_s_last=second,
                   drift=round(abs(first - second) / mean, 4) if mean else None)
        if row["drift"] and row["drift"] > MAX_DRIFT:
            drifted.append(f"{ds}|T{float(t)}|c{c}")
    return drifted


def deploy_schedule(cfg: ServeConfig, chosen: dict[str, dict[str, Any]],
                    draft_dir: str | None) -> dict[str, Any] | None:
    """The speculative config to deploy: vLLM's batch-size schedule (`num_speculative_tokens_per_batch_size`,
    inclusive ranges) built from the K chosen at each measured concurrency, K = 0 where speculation lost.
    Concurrency c_i covers the batch sizes above c_(i-1) up to c_i; above the largest measured concurrency the
    schedule drafts nothing (vLLM carries the last range's K to every larger batch, and speculation there was never
    measured: it tends to lose as the batch grows). None when speculation loses at every load."""
    levels = sorted(cfg.concurrency)
    ks = [int(chosen[f"c{c}"]["deploy_k"]) for c in levels]
    if not any(ks):
        return None
    schedule, start = [], 1
    for c, k in zip(levels, ks, strict=True):
        schedule.append([start, c, k])
        start = c + 1
    if ks[-1]:
        schedule.append([start, start, 0])
    return {**speculative_config(cfg, max(ks), draft_dir), "num_speculative_tokens_per_batch_size": schedule}


def scheduled_speedups(cfg: ServeConfig, table: dict[str, Any]) -> dict[str, float]:
    """The deployed schedule's speed-up over the engine alone at each concurrency (geomean over datasets and
    temperatures): what a user serving it gets, measured in one engine start."""
    out = {}
    for c in cfg.concurrency:
        xs = [temps[f"c{c}"]["scheduled"]["speedup"] for ds in table.values() for temps in ds.values()
              if "scheduled" in temps[f"c{c}"]]
        if xs:
            out[f"c{c}"] = round(statistics.geometric_mean(xs), 4)
    return out
