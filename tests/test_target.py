"""The target loader: local HF folders (fast), the real SmolLM2 GGUF (slow)."""

from __future__ import annotations

import pytest
import torch

from specdistill.core.models.target import TargetConfig, TargetError, load_target

from .helpers.project import ROOT


def test_local_folder_frozen_with_hidden_states(tiny_target_dir):
    t = load_target({"name_or_path": str(tiny_target_dir), "dtype": "float32"})
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.fingerprint.startswith("sha256:")
    ids = torch.tensor([[5, 6, 7, 8]])
    out = t.forward(ids, hidden_layers="all")
    assert out.logits.shape == (1, 4, t.vocab_size) and out.logits.dtype == torch.float32
    assert set(out.hidden) == set(range(t.num_layers + 1)) | {"final"}
    pre, final = out.hidden[t.num_layers], out.hidden["final"]
    # index num_layers is the final norm's input; "final" is its output
    assert torch.allclose(t.model.model.norm(pre), final, atol=1e-5)
    assert not torch.allclose(pre, final)
    chosen = t.forward(ids, hidden_layers=[0, 1]).hidden
    assert set(chosen) == {0, 1}
    reference = t.model(input_ids=ids, output_hidden_states=True).hidden_states  # HF's own indices
    for i in range(t.num_layers):
        assert torch.equal(out.hidden[i], reference[i])
    assert torch.equal(final, reference[-1])
    with pytest.raises(TargetError, match="out of range"):
        t.forward(ids, hidden_layers=[99])


def test_clear_errors():
    with pytest.raises(TargetError, match="run the fetch_assets stage"):
        load_target({"name_or_path": "/nonexistent", "gguf_file": "x.gguf"})
    with pytest.raises(TargetError, match="dtype"):
        load_target({"name_or_path": "/nonexistent", "dtype": "float8"})
    with pytest.raises(TargetError, match="unknown target config keys"):
        TargetConfig.from_dict({"name_or_path": "x", "dtypo": "float32"})
    with pytest.raises(TargetError, match="cannot load target"):
        load_target({"name_or_path": "/nonexistent/folder"})


@pytest.mark.parametrize(("dtype", "native", "warned"), [("bfloat16", False, True), ("bfloat16", True, False),
                                                       ("float32", False, False)])
def test_emulated_bfloat16_is_named_at_load(tiny_target_dir, monkeypatch, caplog, dtype, native, warned):
    """bf16 on a CPU without its kernels is correct but slow for multi-token forwards: say so, and the fix."""
    from specdistill.core import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level("WARNING", logger="specdistill.core.models.target"):
        load_target({"name_or_path": str(tiny_target_dir), "dtype": dtype})
    assert ("target.dtype=auto or float32" in caplog.text) == warned


@pytest.mark.parametrize(("native", "chosen"), [(False, torch.float32), (True, torch.bfloat16)])
def test_auto_dtype_follows_the_cpu(tiny_target_dir, monkeypatch, caplog, native, chosen):
    """target.dtype=auto: bf16 only where the CPU has its kernels, resolved once in the config, so the data's
    fingerprint and every record name the dtype that ran; no emulation warning either way."""
    from specdistill.core import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    assert TargetConfig(name_or_path="x", dtype="auto").dtype == str(chosen).removeprefix("torch.")
    with caplog.at_level("WARNING", logger="specdistill.core.models.target"):
        t = load_target({"name_or_path": str(tiny_target_dir), "dtype": "auto"})
    assert t.dtype == chosen and "without native bfloat16" not in caplog.text


def test_auto_dtype_on_this_machine():
    """What the smoke experiment and CI get here: the real capability, not a patched one."""
    from specdistill.core.hardware import cpu_has_native_bf16

    assert TargetConfig(name_or_path="x", dtype="auto").dtype == ("bfloat16" if cpu_has_native_bf16() else "float32")


@pytest.mark.slow
def test_real_smollm2_target_generates():
    from specdistill.core.data.generation import GenerateConfig, generate_shard

    t = load_target({"name_or_path": str(ROOT / "data/assets/target"),
                     "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "bfloat16"})
    assert (t.num_layers, t.vocab_size, t.config.hidden_size) == (30, 49152, 576)
    assert t.tokenizer.eos_token == "<|im_end|>" and t.tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    prompt = t.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             tokenize=False, add_generation_prompt=True)
    assert "SmolLM" in prompt  # the template's default system prompt
    cols = generate_shard(t.model, t.tokenizer, [{"id": "0", "prompt": prompt}],
                          GenerateConfig(temperature=0.0, max_new_tokens=12), shard_seed=0)
    text = t.tokenizer.decode(cols["input_ids"][0][cols["prompt_len"][0]:])
    assert "Paris" in text
    ids = torch.tensor([cols["input_ids"][0]])
    out = t.forward(ids, hidden_layers=[30, "final"])
    assert out.hidden[30].shape == (1, ids.shape[1], 576)
    assert float(out.hidden[30][0, 0].float().norm()) > 10 * float(out.hidden["final"][0, 0].float().norm())


def _dtypes_here_first() -> list:
    """The dtype this machine's stages load (`auto`: bf16 where the CPU computes it) in `make test`, the other in
    `make test-full`: the copy's code is the same for both, each load from the GGUF costs ~15 s."""
    from specdistill.core.hardware import cpu_has_native_bf16

    here = "bfloat16" if cpu_has_native_bf16() else "float32"
    return [pytest.param(d, marks=[] if d == here else [pytest.mark.full]) for d in ("bfloat16", "float32")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", _dtypes_here_first())
def test_the_dequantised_copy_loads_the_same_target_as_the_gguf(tmp_path, monkeypatch, dtype):
    """The first load keeps a dequantised copy (core/models/dequantised.py); a later load reads it, and gets the same
    weights, config, tokenizer, chat template, stop ids, fingerprint and logits as a load from the GGUF."""
    from specdistill.core.models import dequantised
    from specdistill.core.models.target import load_target_config, load_tokenizer

    cfg = {"name_or_path": str(ROOT / "data/assets/target"), "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
           "dtype": dtype}
    monkeypatch.setenv(dequantised.CACHE_ENV, "off")
    direct = load_target(cfg)
    monkeypatch.setenv(dequantised.CACHE_ENV, str(tmp_path))
    gguf = ROOT / "data/assets/target/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert dequantised.cached(gguf, dtype) is None
    first = load_target(cfg)  # a miss: from the GGUF, and the copy written
    folder = dequantised.cached(gguf, dtype)
    assert folder is not None and folder.parent == tmp_path / "targets" and not list(folder.parent.glob(".*"))
    again = load_target(cfg)  # a hit
    for t in (first, again):
        assert t.fingerprint == direct.fingerprint and t.stop_ids == direct.stop_ids and t.dtype == direct.dtype
        a, b = direct.model.state_dict(), t.model.state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert load_target_config(TargetConfig(**cfg)).to_dict() == again.config.to_dict()
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # über 世界"
    chat = [{"role": "user", "content": text}]
    for tok in (again.tokenizer, load_tokenizer(TargetConfig(**cfg))):
        assert tok(text)["input_ids"] == direct.tokenizer(text)["input_ids"]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            direct.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([direct.tokenizer(text)["input_ids"]])
    assert torch.equal(direct.forward(ids).logits, again.forward(ids).logits)
    (folder / "specdistill.json").write_text('{"target_fingerprint": "sha256:other"}')  # not this GGUF's: ignored
    assert dequantised.cached(gguf, dtype) is None
