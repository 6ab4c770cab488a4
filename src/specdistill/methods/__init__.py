"""The method registry: each speculative method is one object that says what every stage needs of it.

A stage asks the registry (`get(name, "train")`) and never names a method; adding one means its own module
here, registered with `register(Method(...))`, its `conf/methods/<m>.yaml` (how it trains) and
`conf/decode/<m>.yaml` (how it drafts), and its `dvc.yaml` items. What a
method may declare (each optional; a stage refuses a method without its part, listing those that have it):

- train: `config` (its `methods.<m>` dataclass) and `build` (the Lightning module, the trained part, how to
  save it), with `label` (its name in sweep outputs), `reads_hidden` (a head on the frozen target's hidden
  states, which needs the target's own states on fixed data) and `precomputed` (it can read the features
  stage's store);
- evaluate: `decode` (its `decode.<m>` dataclass: its trained folder, its tree; a method that trains nothing, like
  suffix decoding, keeps all its settings there) and `draft`, the proposer our decoder verifies, with what the
  metrics say about it; `sampled_chain` if it can take a branch, `companion` if it can be one (a deterministic
  tree from nothing trained, reported beside other methods or merged into their trees);
- online: `online`, the student that keeps learning while it serves, and its serving copy;
- export and serve: `export` (an engine-ready folder) and `engine` (vLLM's `speculative_config`), with
  `ours` (our decoder's proposer on the same chain, for the agreement table).

The built-in methods are registered on import: draft (a separate small LM), medusa, eagle and eagle1, dflash, lookup
(prompt lookup, ours), ngram (the engine's prompt lookup) and suffix (suffix decoding).
"""

from __future__ import annotations

from specdistill.methods import dflash, draft, eagle, lookup, medusa, suffix  # noqa: F401 (registers the built-ins)
from specdistill.methods.registry import (  # noqa: F401 (the registry's interface, re-exported)
    CAPABILITIES,
    REGISTRY,
    Built,
    Drafting,
    Method,
    OnlineStudent,
    companions,
    decode_settings,
    describe,
    describe_training,
    get,
    merged,
    names,
    register,
    trained_folder,
)
