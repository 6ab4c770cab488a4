"""Config sections as dataclasses: `section` builds one from a composed section and refuses, before anything
runs, unknown keys, values of the wrong type and values out of the class's `RANGES`, naming the key. The one
helper every stage and every method's config goes through (the defaults themselves live in conf/)."""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from specdistill.core.errors import ConfigError
from specdistill.core.io import sha256_cached_all

T = TypeVar("T")


def section(cls: type[T], values: dict[str, Any], where: str, **extra: Any) -> T:
    """Build dataclass `cls` from a config section, before any output is touched: unknown keys, values of the
    wrong type (`generate.temperature=hot`) and values out of the class's `RANGES` are errors that name the key,
    the value and what it must be."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in `{where}`; valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    ranges = getattr(cls, "RANGES", {})
    for key, value in values.items():
        if not _is_a(value, hints.get(key, Any)):
            raise ConfigError(f"`{where}.{key}={value!r}`: must be {_type_name(hints[key])}")
        if key in ranges:
            for v in value if isinstance(value, list) else [value]:
                # a number's range; a word the type admits (eval.depth=auto) is its stage's to check
                if isinstance(v, int | float) and not _in_range(v, ranges[key]):
                    raise ConfigError(f"`{where}.{key}={value!r}`: must be in {ranges[key]}")
    try:
        return cls(**{**values, **extra})
    except TypeError as e:
        raise ConfigError(f"`{where}`: {e}") from e


def _is_a(value: Any, hint: Any) -> bool:
    """Whether a config value fits a dataclass annotation (int is no bool; a float takes an int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is list or hint is list:
        return isinstance(value, list) and all(_is_a(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _in_range(v: Any, interval: str) -> bool:
    """`v` in an interval written as in the message: "[0, 2]", "(0, 1]", "[1, inf)"."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return (lo <= v if interval[0] == "[" else lo < v) and (v <= hi if interval[-1] == "]" else v < hi)


def files_stamp(path: str | None) -> str | None:
    """What a local model folder holds when the config is composed: a digest of each file's relative path and
    sha256 (dot-folders such as a download's .cache/ left out). It goes into params.yaml (`target.stamp`,
    conf/target/hf.yaml), so weights replaced at the same path change the params the target's stages read and DVC
    reruns them, while a copy of the same weights elsewhere (a teammate's clone, new modification times) gives the
    same stamp. Each file's sha256 is kept in the project's cache under its path, size, mtime and inode, so only a
    changed file is read again. None for what is not a local path: a hub id is pinned by target.revision."""
    if not path:
        return None
    root = Path(path)
    if not root.exists():
        return None
    files = [root] if root.is_file() else sorted(
        f for f in root.rglob("*") if f.is_file() and not any(part.startswith(".") for part in
                                                              f.relative_to(root).parts))
    h = hashlib.sha256()
    for f, digest in zip(files, sha256_cached_all(files), strict=True):
        h.update(f"{f.relative_to(root).as_posix() if f != root else f.name}\0{digest}\n".encode())
    return f"{len(files)} files:{h.hexdigest()[:16]}"


def register_resolvers() -> None:
    """The resolvers conf/ uses (`${files_stamp:...}`), for every composition: DVC's (`dvc exp run` and
    pipelines/compose.py, through hydra_plugins/), a stage run by hand (pipelines/_entry.py) and the tests."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("files_stamp"):
        OmegaConf.register_new_resolver("files_stamp", files_stamp)
