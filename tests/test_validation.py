"""A bad value fails at start and leaves what an earlier good run wrote byte-identical (hardening, items 2-3).

Each run goes through the real config and stage, in a temporary copy of the project holding outputs of an
earlier run (generated shards and their fingerprint, a checkpoint, evaluate metrics)."""

from __future__ import annotations

import pytest

from specdistill.core.errors import ConfigError

from .helpers.checkout import composed, snapshot, stage_run


@pytest.fixture
def earlier_outputs(checkout):
    for f, text in {"data/generated/FINGERPRINT": "abc\n", "data/generated/manifest.json": "{}",
                    "data/generated/train/shard-00000/data-00000-of-00001.arrow": "shard",
                    "checkpoints/draft/FINGERPRINT": "def\n", "metrics/draft.json": '{"results": {"x": 1}}',
                    "plots/draft/.specdistill-output": "marker"}.items():
        (checkout / f).parent.mkdir(parents=True, exist_ok=True)
        (checkout / f).write_text(text)
    return checkout


CASES = [  # item 2: typos that once wiped shards or last.ckpt; item 3: out-of-range values that once ran
    ("generate", "generate.temperature=hot", "generate.temperature"),
    ("generate", "generate.batch_size=2.5", "generate.batch_size"),
    ("generate", "generate.temperature=-1.0", "generate.temperature"),
    ("generate", "generate.top_k=-3", "generate.top_k"),
    ("evaluate", "eval.top_p=0", "eval.top_p"),
    ("evaluate", "eval.top_p=1.5", "eval.top_p"),
    ("evaluate", "eval.k=0", "eval.k"),
    ("evaluate", "eval.k=-2", "eval.k"),
    ("evaluate", "eval.k=two", "eval.k"),
    ("evaluate", "eval.temperatures=[-0.5]", "eval.temperatures"),
    ("evaluate", "eval.num_prompts=0", "eval.num_prompts"),
    ("evaluate", "eval.capacity=64 eval.max_new_tokens=200", "eval.capacity"),  # once a RuntimeError mid-run
    ("train", "methods.medusa.num_heads=four", "methods.medusa.num_heads"),
    # item 3 again, for the sections the first pass left out: every numeric key has its range
    ("train", "distill.data.batch_size=0", "distill.data.batch_size"),
    ("train", "distill.data.mix_lambda=1.5", "distill.data.mix_lambda"),
    ("train", "distill.tau_k=0", "distill.tau_k"),
    ("train", "methods.draft.loss.temperature=0", "methods.draft.loss.temperature"),
    ("train", "methods.draft.draft.num_layers=0", "methods.draft.draft.num_layers"),
    ("train", "methods.medusa.num_heads=0", "methods.medusa.num_heads"),
    ("train", "methods.eagle.ttt_steps=0", "methods.eagle.ttt_steps"),
    ("online", "online.requests=0", "online.requests"),
    ("online", "online.lr=-1e-4", "online.lr"),
    ("features", "features.topk=0", "features.topk"),
    ("prepare", "data.val_fraction=1.5", "data.val_fraction"),
    # second round: a Lightning key once deleted last.ckpt and the step checkpoints, then failed naming no key;
    # others ran and overwrote results, or failed naming another key or only the section
    ("train", "trainer.val_check_interval=0", "trainer.val_check_interval"),
    ("train", "trainer.max_steps=many", "trainer.max_steps"),
    ("train", "trainer.max_steps=-5", "trainer.max_steps"),
    ("train", "+methods.draft.trainer.max_steps=-5", "methods.draft.trainer.max_steps"),
    ("train", "trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches"),
    ("train", "methods.draft.optimizer.lr=fast", "methods.draft.optimizer.lr"),
    ("train", "methods.draft.optimizer.lr=0", "methods.draft.optimizer.lr"),
    ("train", "distill.scheduler.num_warmup_steps=-5", "distill.scheduler.num_warmup_steps"),
    ("train", "methods.draft.vocab_size=1", "methods.draft.vocab_size"),
    # third round: no validation batches failed after the whole training (the record is the final validation)
    ("train", "trainer.limit_val_batches=0", "trainer.limit_val_batches"),
]


@pytest.mark.parametrize("stage,override,key", CASES, ids=[c[1] for c in CASES])
def test_a_bad_value_fails_at_start_and_keeps_earlier_outputs(earlier_outputs, stage, override, key):
    before = snapshot(earlier_outputs)
    method = key.split(".")[1] if key.startswith("methods.") else "draft"  # the key, not the override's `+`
    extra = [f"method={method}"] if stage == "train" else []
    cfg = composed(earlier_outputs, *override.split(), *extra)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        stage_run(stage)(cfg)
    assert snapshot(earlier_outputs) == before


OUTPUT_IN_THE_WAY = [  # item 5: a file where an output goes once failed only after all the decoding or training
    ("evaluate", "metrics/default/draft.json", "dir", r"metrics/default/draft\.json \(from `eval\.name`\) is a folder"),
    ("evaluate", "metrics", "file", r"paths\.metrics_dir=metrics.* is a file"),
    ("train", "plots", "file", r"paths\.plots_dir=plots.* is a file"),
    ("generate", "metrics", "file", r"paths\.metrics_dir=metrics.* is a file"),
]


@pytest.mark.parametrize("stage,path,kind,message", OUTPUT_IN_THE_WAY,
                         ids=[f"{c[0]}-{c[1]}" for c in OUTPUT_IN_THE_WAY])
def test_an_output_path_in_the_way_fails_at_start(earlier_outputs, stage, path, kind, message):
    from specdistill.core.outputs import OutputError

    target = earlier_outputs / path
    if target.is_dir():
        import shutil

        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    if kind == "dir":
        (target / "x").mkdir(parents=True)
    else:
        target.write_text("in the way")
    before = snapshot(earlier_outputs)
    cfg = composed(earlier_outputs, *(["method=draft"] if stage == "train" else []))
    with pytest.raises(OutputError, match=message):
        stage_run(stage)(cfg)
    assert snapshot(earlier_outputs) == before

