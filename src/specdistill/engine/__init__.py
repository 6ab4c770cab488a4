"""The serving engine (vLLM) as its own process: environment, jobs, results."""
