"""Fixtures: a tiny random Llama with a real (tiny, byte-level BPE) tokenizer and a chat template.

Nothing is downloaded: the tokenizer is trained in memory on a few sentences, the model is random.
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

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ROOT = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a poem about the sea and the sky.",
    "def add(a, b):\n    return a + b\n",
    "Explain speculative decoding to a child in three sentences.",
    "What is the capital of France? Paris is the capital of France.",
] * 20


def make_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def make_model(vocab_size: int, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    # a sharper random distribution than the default init, so sampling tests see structure
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def make_engine_model(vocab_size: int, seed: int = 0):
    """A tiny random Llama the CPU engine serves (2 heads of 64: its attention kernels need that head size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a sharp distribution: greedy ties are rare
    return model


def save_mtbench(prompts_dir: Path, turns: tuple[str, ...] = ("Write a poem.", "Shorter.")) -> None:
    """One MT-bench conversation in the prompt contract, saved where the evaluate stage reads it."""
    from specdistill.stages.prepare import save_split

    rows = [{"id": "0", "messages": [{"role": "user", "content": turns[0]}], "source": "mtbench", "category": "x",
             "reference": "", "turns": list(turns), "prompt": "", "prompt_tokens": 1}]
    save_split(rows, prompts_dir / "mtbench")


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


def pytest_collection_modifyitems(config, items):
    from specdistill.engine.client import EngineError, engine_python

    gguf = ROOT / "data/assets/target/SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        engine_python()
        no_engine = None
    except EngineError as e:
        no_engine = str(e)
    for item in items:
        if "slow" in item.keywords and not gguf.exists():
            item.add_marker(pytest.mark.skip(reason=f"{gguf} is missing: run `make assets` (the fetch_assets stage)"))
        if "engine" in item.keywords and no_engine:
            item.add_marker(pytest.mark.skip(reason=no_engine))


def copy_checkout(dest: Path, skip: tuple[str, ...] = ("reports/", "plots/", "metrics/")) -> Path:
    """The project's files (tracked, and untracked ones git does not ignore) copied to `dest`, without the
    outputs under `skip`: a checkout to run stages in without touching this one."""
    import shutil
    import subprocess

    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file() and not f.startswith(skip):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def front_door(stage: str):
    """pipelines/<stage>.py as a module (its helpers, e.g. train's shorthand `method_groups`), without running it."""
    import importlib.util
    import sys

    name = f"_front_door_{stage}"
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "pipelines"))  # its `from _entry import ...`
        spec = importlib.util.spec_from_file_location(name, ROOT / "pipelines" / f"{stage}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
