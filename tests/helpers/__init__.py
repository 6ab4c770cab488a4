"""Plain helpers the test modules share: functions, classes and constants, no tests and no fixtures (those are
in tests/conftest.py). A test module imports from here, never from another test module.

- project: the checkout's root and its stages' front doors (pipelines/<stage>.py)
- checkout: a temporary copy of the project to run stages in, and what to check it with
- config: the project's config as Hydra composes it
- train: the train stage's config on the tiny target (its overrides, composed as its front door does)
- models: the tiny tokenizer and the tiny random Llamas
- data: generated splits and prompt splits on disk
- generation: the generate stage on the tiny target (its prompts, config and shards)
- decoding: bigram targets and proposers whose output law is exact, and greedy references
- drafts: drafters for the tests (random heads for the tiny target, random ones over the bigram vocabulary)
- evaluate: the evaluate stage on the tiny target, and the texts it wrote
- report: the metrics records the report stage reads
- stats: the goodness-of-fit test the losslessness tests share
"""
