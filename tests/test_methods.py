"""The method registry: stages ask it and name no method; a new method is its own module, registered."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from specdistill import methods
from specdistill.errors import ConfigError

from .helpers.project import ROOT

# the stages and the report: each method describes itself (`Method.describe`), so neither names one
STAGES = sorted([*(ROOT / "src/specdistill/stages").glob("*.py"), *(ROOT / "src/specdistill/reporting").glob("*.py")])


@pytest.mark.parametrize("path", STAGES, ids=[f"{p.parent.name}/{p.stem}" for p in STAGES])
def test_no_stage_names_a_method_or_imports_its_module(path):
    names = set(methods.REGISTRY)
    text = path.read_text()
    # a method name compared with a variable that holds one (`method == "eagle"`, `name in ("draft", ...)`)
    compared = re.findall(r"""\b\w*(?:method|name)\w*\s*(?:==|!=|\bin)\s*\(?["'](\w+)["']""", text)
    assert not names & set(compared), f"{path.name} branches on a method name: {sorted(names & set(compared))}"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("specdistill.methods."), f"{path.name} imports {node.module}"


def test_capabilities_and_errors_name_the_choices():
    assert set(methods.names("train")) == {"draft", "medusa", "eagle", "eagle1", "dflash"}
    assert set(methods.names("evaluate")) == {"draft", "medusa", "eagle", "dflash", "lookup", "suffix"}
    assert set(methods.names("serve")) == {"draft", "medusa", "eagle", "dflash", "ngram"}
    with pytest.raises(ConfigError, match=r"eval\.method='ngram': use one of .*\(ngram has no evaluate part\)"):
        methods.get("ngram", "evaluate", "eval.method")
    with pytest.raises(ConfigError, match=r"method='hydra': use one of"):
        methods.get("hydra", "train")


def test_a_method_registered_from_outside_reaches_the_stages(monkeypatch):
    """A plug-in: registered by its own module, it is a choice of every stage whose part it has."""
    from specdistill.decoding.proposers import PromptLookupProposer
    from specdistill.stages.evaluate import EvalConfig

    def drafting(ecfg, target, dec):
        return methods.Drafting(PromptLookupProposer(ecfg.k, 4, 4, 1), {"note": "4-grams only"})

    monkeypatch.setitem(methods.REGISTRY, "lookup4", methods.Method("lookup4", "prompt lookup on 4-grams",
                                                                    draft=drafting))
    assert "lookup4" in methods.names("evaluate") and "lookup4" not in methods.names("train")
    assert EvalConfig(method="lookup4").method == "lookup4"
    with pytest.raises(ConfigError, match="use one of"):
        EvalConfig(method="lookup5")


def test_every_trainable_method_has_its_config_file():
    for name in methods.names("train"):
        assert (ROOT / "conf/methods" / f"{name}.yaml").exists(), name
        assert Path(ROOT / "conf/config.yaml").read_text().count(f"methods@methods.{name}: {name}") == 1


def test_a_stage_names_each_methods_trained_folder_in_its_models_map():
    """export and serve read the folder a method trained from their `models` map; a missing entry is named."""
    from types import SimpleNamespace

    assert methods.trained_folder(SimpleNamespace(models={"eagle": "models/eagle"}), "eagle", "export") == \
        "models/eagle"
    with pytest.raises(ConfigError, match=r"serve\.models\.medusa is not set.*serve\.models\.medusa=models/medusa"):
        methods.trained_folder(SimpleNamespace(models={"eagle": "models/eagle"}), "medusa", "serve")


def test_decode_keys_for_a_method_without_decode_settings_are_refused():
    with pytest.raises(ConfigError, match=r"decode keys \['k'\] were set for method=ngram"):
        methods.decode_settings({}, "ngram", {"k": 2})


def test_an_items_decode_keys_are_set_key_by_key_over_the_methods_section():
    """A nested key (`tree: {top_k: 2}`) keeps the section's other tree keys; an item's decode keys keep the shared
    eval section's too."""
    from specdistill.stages.evaluate import eval_item

    cfg = {"decode": {"eagle": {"path": "models/eagle", "tree": {"shape": "dynamic", "depth": 6, "top_k": 10,
                                                                   "total_tokens": 60}}}}
    dec = methods.decode_settings(cfg, "eagle", {"tree": {"top_k": 2, "total_tokens": 20}})
    assert dec.tree == {"shape": "dynamic", "depth": 6, "top_k": 2, "total_tokens": 20} and dec.path == "models/eagle"
    item = eval_item({"eval": {"name": "e", "method": "eagle", "decode": {"tree": {"top_k": 2}}},
                      "evals": {"e": {"method": "eagle", "decode": {"path": "models/eagle31"}}}})
    assert item["decode"] == {"tree": {"top_k": 2}, "path": "models/eagle31"}
