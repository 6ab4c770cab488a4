"""One `run(cfg)` per pipeline stage; `pipelines/<stage>.py` composes the config and calls it.

`cfg` is a plain nested dict (the composed Hydra config, resolved), so the library needs no Hydra.
"""
