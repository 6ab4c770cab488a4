"""What every stage run shares: logging set-up, config sections as dataclasses, run settings."""

from __future__ import annotations

import dataclasses
import logging
import platform
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import torch

from specdistill import hardware
from specdistill.errors import ConfigError  # noqa: F401 (re-exported: stages raise it)
from specdistill.outputs import MARKER, check_files, check_paths, check_replaceable, lock_output, plain_name

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


def check_outputs(cfg: dict[str, Any], names: dict[str, Any] | None = None,
                  replaced: dict[str, Path] | None = None, fingerprinted: dict[str, Path] | None = None,
                  files: dict[str, Path | list[Path]] | None = None, locked: dict[str, Path] | None = None) -> None:
    """At a stage's start, before any model loads: the names that become paths are plain names, no `paths.*`
    folder is the project or above it, and every folder the stage will replace whole is one a stage wrote
    (`replaced`: the marker of `io.atomic_path`; `fingerprinted`: a resumable output's FINGERPRINT).
    `files`: output files (one or a list per key), checked to be writable (no folder in their place, no file where
    their folder goes).
    Every output named (and `locked`: outputs a stage only adds to) is then locked for the rest of the run
    (`outputs.lock_output`).
    Keys are the config keys to name in the error."""
    plain_name(cfg.get("experiment_name", "default"), "experiment_name")
    for key, value in (names or {}).items():
        plain_name(value, key)
    check_paths(cfg.get("paths") or {})
    for key, folder in (replaced or {}).items():
        check_replaceable(folder, key, (MARKER,))
    for key, folder in (fingerprinted or {}).items():
        check_replaceable(folder, key, ("FINGERPRINT",))
    each_file = [(key, p) for key, v in (files or {}).items() for p in (v if isinstance(v, list) else [v])]
    for key, path in each_file:
        check_files({key: path})
    for key, path in [*(replaced or {}).items(), *(fingerprinted or {}).items(), *each_file, *(locked or {}).items()]:
        lock_output(path, key)  # held to the end of the run: a second run on the same output is refused


def cross_limits(cfg: dict[str, Any]) -> None:
    """Limits that span two sections, checked on the whole config before any model loads (and by
    `pipelines/compose.py` when it writes params.yaml): a stage that needs more prompts than `prepare` keeps."""
    data, online = cfg.get("data") or {}, cfg.get("online") or {}
    if online:
        key = {"code": "num_humaneval", "chat": "num_val"}.get(online.get("scenario"))
        have, need = data.get(key) if key else None, int(online.get("requests", 0)) + int(online.get("held_out", 0))
        if have is not None and need > int(have):
            raise ConfigError(f"online.requests + online.held_out = {need}, but data.{key} = {have} prompts are prepared "
                              f"for online.scenario={online.get('scenario')}: lower online.requests / online.held_out "
                              f"or raise data.{key}")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "transformers.modeling_utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def environment() -> dict[str, Any]:
    """What a measurement ran on. On a CPU the kind matters as much as the versions: without bf16 kernels
    (AVX2) a draft tree's verification costs several times more plain steps than with AMX, so a speed-up
    only compares with one measured on the same kind."""
    import transformers

    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(),
                           "device": torch.cuda.get_device_name(0) if cuda else hardware.cpu_name(),
                           "threads": torch.get_num_threads()}
    if not cuda:
        env["cpu"] = {"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": hardware.cpu_has_native_bf16()}
    return env
