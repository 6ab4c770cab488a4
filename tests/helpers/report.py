"""The metrics records the report stage reads."""

from __future__ import annotations


def metrics(method: str, alphas: list[float], tau: float, ci: list[float] | None = None) -> dict:
    spec = {"tokens": 64, "seconds": 2.0, "tokens_per_s": 32.0, "tau": tau, "speedup": 1.6,
            **({"speedup_ci95": ci} if ci else {}),
            "speedup_vs_hf_assisted": 2.1, **{f"alpha_pos{k}": a for k, a in enumerate(alphas, start=1)}}
    setting = {"ar": {"tokens": 64, "seconds": 3.2, "tokens_per_s": 20.0, "tau": 1.0, "speedup": 1.0,
                      "speedup_ci95": [1.0, 1.0]},
               "hf_generate": {"tokens": 64, "seconds": 4.0, "tokens_per_s": 16.0, "speedup": 0.8},
               "spec": spec}
    return {"method": method, "settings": {"k": len(alphas), "dtype": "bfloat16", "prompts": {"mtbench": 2},
                                           "max_new_tokens": 64, "chain_or_tree": "chain", "draft": "d"},
            "results": {"mtbench": {"T0": setting}}}
