"""Fixtures and hooks the test modules share: the tiny random Llama, its tokenizer and saved folder, a target built
from them, generated splits, a copy of the checkout, and one-thread torch for the statistical tests.

The plain helpers they are built from are in tests/helpers/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

# CI draws the same hypothesis examples every run (a property test that fails there fails here too, and one rare
# draw cannot sink a submission); a local run keeps exploring new examples and stores what it finds in .hypothesis/
from hypothesis import settings  # noqa: E402

# after the environment above: the helpers import datasets
from .helpers.checkout import copy_checkout  # noqa: E402
from .helpers.data import write_split  # noqa: E402
from .helpers.models import make_model, make_tokenizer  # noqa: E402
from .helpers.project import ROOT  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_model(len(tiny_tokenizer))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer, tiny_model) -> Path:
    """A local HF folder (safetensors) that `target=hf target.name_or_path=<dir>` loads."""
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    return make_model(len(tiny_tokenizer), seed=0)


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("generated")
    write_split(d / "train", 24, 0, len(tiny_tokenizer))
    write_split(d / "val", 9, 1, len(tiny_tokenizer))  # batch 2: 5 batches, 3 + 2 on 2 ranks (unequal tokens)
    (d / "FINGERPRINT").write_text("tiny\n")
    return d


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the project's tracked files, with a `.git`, data and outputs of its own, as the cwd."""
    proj = copy_checkout(tmp_path / "a" / "b" / "proj")  # two levels down: `../../escaped` must not reach tmp_path
    for f, text in {".git/HEAD": "ref: refs/heads/main\n", "data/prompts/train/data.arrow": "prompts",
                    "data/assets/target/model.gguf": "weights", "models/eagle/model.safetensors": "eagle",
                    "metrics/eagle.json": "{}", "checkpoints/draft/last.ckpt": "ckpt"}.items():
        (proj / f).parent.mkdir(parents=True, exist_ok=True)
        (proj / f).write_text(text)
    monkeypatch.chdir(proj)
    return proj


@pytest.fixture
def one_thread():
    """Thousands of ops on 8-entry tensors: OpenMP's thread hand-off costs more than the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the heavier tier too (`make test-full`): tests marked `full`, and the lossless suite at its "
                          "larger sample size")


@pytest.fixture(scope="session")
def full_tier(request) -> bool:
    """`pytest --full` (`make test-full`): the heavier tier, where a test sizes itself up."""
    return bool(request.config.getoption("--full"))


def pytest_collection_modifyitems(config, items):
    from specdistill.engine.client import EngineError, engine_python

    gguf = ROOT / "data/assets/target/SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        engine_python()
        no_engine = None
    except EngineError as e:
        no_engine = str(e)
    for item in items:
        if item.get_closest_marker("full") and not config.getoption("--full"):
            item.add_marker(pytest.mark.skip(reason="the heavier tier: `make test-full` (pytest --full) runs it"))
        if "slow" in item.keywords and not gguf.exists():
            item.add_marker(pytest.mark.skip(reason=f"{gguf} is missing: run `make assets` (the fetch_assets stage)"))
        if "engine" in item.keywords and no_engine:
            item.add_marker(pytest.mark.skip(reason=no_engine))
