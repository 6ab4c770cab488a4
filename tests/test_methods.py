"""The method registry: stages ask it and name no method; a new method is its own module, registered."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specdistill import methods
from specdistill.core.errors import ConfigError

from .helpers.project import ROOT

# the stages, the evaluation and the report: each method describes itself (`Method.describe`, its own tables), so none
# names one
STAGES = sorted(p for folder in ("stages", "reporting", "evaluation")
                for p in (ROOT / "src/specdistill" / folder).glob("*.py"))
KEYS = ("get", "pop", "setdefault")  # a mapping's key: the `draft` section (conf/draft/, a size) is no method


def method_strings(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """String constants equal to a registered method's name, except a mapping's key (`s["draft"]`, `s.get("draft")`,
    `{"draft": ...}`, `"draft" in shared`, a tuple of section keys), a dataclass field's default (config, not a
    branch) and a line that reads records written before a key existed (marked `# a record written before`)."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            allowed.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KEYS:
            allowed |= {id(a) for a in node.args[:1]}
        elif isinstance(node, ast.Dict):
            allowed |= {id(k) for k in node.keys if k is not None}
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and isinstance(node.comparators[0],
                                                                                               ast.Name):
            allowed.add(id(node.left))
        elif isinstance(node, ast.Tuple) and any(isinstance(e, ast.Constant) and e.value not in names
                                                 for e in node.elts):
            allowed |= {id(e) for e in node.elts}
        elif isinstance(node, ast.ClassDef):
            allowed |= {id(s.value) for s in node.body if isinstance(s, ast.AnnAssign) and s.value is not None}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in allowed]


@pytest.mark.parametrize("path", STAGES, ids=[f"{p.parent.name}/{p.stem}" for p in STAGES])
def test_no_stage_names_a_method_or_imports_its_module(path):
    names = set(methods.all_methods())
    text = path.read_text()
    lines = text.splitlines()
    named = [(n, s) for n, s in method_strings(ast.parse(text), names)
             if "# a record written before" not in lines[n - 1]]
    assert not named, f"{path.name} names a method: {named}"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("specdistill.methods."), f"{path.name} imports {node.module}"


def test_the_guard_finds_a_method_named_in_code():
    code = 'if cfg.method == "medusa":\n    x = "eagle"\ny = s["draft"]\n'
    found = method_strings(ast.parse(code), {"medusa", "eagle", "draft"})
    assert [s for _, s in found] == ["medusa", "eagle"]


def test_capabilities_and_errors_name_the_choices():
    assert set(methods.names("train")) == {"draft", "medusa", "eagle", "dflash"}
    assert set(methods.names("evaluate")) == {"draft", "medusa", "eagle", "dflash", "lookup", "suffix"}
    assert set(methods.names("serve")) == {"draft", "medusa", "eagle", "dflash", "lookup"}
    with pytest.raises(ConfigError, match=r"serve\.method='suffix': use one of .*\(suffix has no serve part\)"):
        methods.get("suffix", "serve", "serve.method")
    with pytest.raises(ConfigError, match=r"method='hydra': use one of"):
        methods.get("hydra", "train")


def test_a_method_registered_from_outside_reaches_the_stages(monkeypatch):
    """A plug-in: registered by its own module, it is a choice of every stage whose part it has."""
    from specdistill.methods.lookup.proposer import PromptLookupProposer
    from specdistill.stages.evaluate import EvalConfig

    def drafting(eval_cfg, target, dec):
        return methods.Drafting(PromptLookupProposer(eval_cfg.k, 4, 4, 1), {"note": "4-grams only"})

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
    with pytest.raises(ConfigError, match=r"serve\.items\.medusa\.ours is not set.*ours=models/medusa"):
        methods.trained_folder(SimpleNamespace(models={"eagle": "models/eagle"}), "medusa", "serve")


def test_decode_keys_for_a_method_without_decode_settings_are_refused():
    methods.register(methods.Method("served_only", "a method with no decode settings of ours"))
    try:
        with pytest.raises(ConfigError, match=r"decode keys \['k'\] were set for method=served_only"):
            methods.decode_settings({}, "served_only", {"k": 2})
    finally:
        del methods.REGISTRY["served_only"]


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
