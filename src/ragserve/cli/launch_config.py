"""``LaunchConfig``: everything ``serve`` / ``ask`` / ``demo`` start a Server with, as data:
read from a config file (TOML, YAML, JSON; layout in the README under ``--config FILE``), then
the flags (``from_args``); ``dump_toml`` writes it back so that reading the dump gives an equal
config (TOML has no null: ``None`` fields are left out, and a field left out keeps its default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragserve.cli.errors import UsageError
from ragserve.cli.options import (
    DEFAULT_INDEX,
    DEFAULT_MODEL,
    RUNTIME_FLAGS,
    engine_flags,
    given,
)
from ragserve.runtime.config import ServerConfig
from ragserve.scheduler.cosched import CoScheduleConfig
from ragserve.server.config import ServeConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib

TOP_LEVEL = ("model", "index", "embedder", "workflows", "cosched")
SECTIONS = ("engine", "runtime", "cosched", "serve", "gpu_tier", "document_limits", "operators")
# ServerConfig fields that are sections of their own in the file.
_RUNTIME_SKIP = ("engine_kwargs", "cosched", "gpu_tier", "document_limits", "operators")
# the annotations a file value of each kind may fill (bool first: a bool is an int)
_ANNOTATIONS = ((bool, ("bool",)), (int, ("int", "float")), (float, ("float",)), (str, ("str",)))


class ConfigError(UsageError):
    """A config file that cannot be read, or a key or value it must not hold."""


@dataclass(frozen=True)
class LaunchConfig:
    """What a command starts: ``Server(model, index, embedder, config=runtime)`` with the
    user graphs ``workflows`` (``module:function`` specs), behind the HTTP front's ``serve``."""

    model: str = DEFAULT_MODEL
    index: str = DEFAULT_INDEX
    embedder: str | None = None
    workflows: tuple[str, ...] = ()
    runtime: ServerConfig = field(default_factory=ServerConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


def from_args(
    args: argparse.Namespace, engine_defaults: dict[str, Any] | None = None
) -> LaunchConfig:
    """``LaunchConfig()`` with ``engine_defaults`` (the command's), then ``--config``, then the
    flags of ``options.add_server_args``."""
    base = LaunchConfig(runtime=ServerConfig(engine_kwargs=engine_defaults or ()))
    config = from_mapping(read_file(args.config), base) if args.config else base
    top = {k: getattr(args, k) for k in ("model", "index", "embedder") if getattr(args, k)}
    engine = {**dict(config.runtime.engine_kwargs), **engine_flags(args)}
    runtime: dict[str, Any] = {"engine_kwargs": engine, **given(args, RUNTIME_FLAGS)}
    if args.in_process is not None:
        runtime["in_process"] = args.in_process
    if args.cosched is not None:
        cosched = config.runtime.cosched
        names = [f.name for f in dataclasses.fields(cosched) if not f.name.startswith("enable_")]
        try:
            knobs = {name: getattr(cosched, name) for name in names}
            runtime["cosched"] = CoScheduleConfig.from_names(args.cosched, **knobs)
        except ValueError as exc:
            raise UsageError(f"--{exc}") from exc
    runtime_config = dataclasses.replace(config.runtime, **runtime)
    return dataclasses.replace(config, **top, runtime=runtime_config)


def read_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a ``.toml`` / ``.yaml`` / ``.yml`` / ``.json`` file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    kind = {".toml": "toml", ".json": "json", ".yaml": "YAML", ".yml": "YAML"}.get(
        path.suffix.lower()
    )
    if kind is None:
        raise ConfigError(f"config file {path}: use a .toml, .yaml or .json file")
    errors: tuple = (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError)
    try:
        text = path.read_text(encoding="utf-8")
        if kind == "YAML":
            try:
                import yaml
            except ImportError as exc:
                raise ConfigError(
                    f"config file {path}: YAML needs PyYAML (pip install pyyaml)"
                ) from exc
            errors += (yaml.YAMLError,)
            data = yaml.safe_load(text) or {}
        else:
            data = (tomllib.loads if kind == "toml" else json.loads)(text)
    except errors as exc:
        raise ConfigError(f"config file {path} is not valid {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys")
    return data


def from_mapping(data: dict[str, Any], base: LaunchConfig | None = None) -> LaunchConfig:
    """``base`` (default: ``LaunchConfig()``) with the file's values applied; an unknown
    key or a bad value raises ``ConfigError`` naming it."""
    base = base or LaunchConfig()
    unknown = sorted(set(data) - set(TOP_LEVEL) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"config: unknown key {unknown[0]!r}; top-level keys are {', '.join(TOP_LEVEL)} "
            f"and the sections [{'], ['.join(SECTIONS)}]"
        )
    top = {k: data[k] for k in ("model", "index", "embedder") if k in data}
    for key, value in top.items():
        if not isinstance(value, str) or not value:
            raise ConfigError(f"config: {key} must be a non-empty string, got {value!r}")
    if "workflows" in data:
        specs = data["workflows"]
        if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
            raise ConfigError("config: workflows must be a list of 'module:function' strings")
        top["workflows"] = tuple(specs)
    runtime = _apply_runtime(base.runtime, data)
    serve = _replace(base.serve, _section(data, "serve"), "serve")
    return dataclasses.replace(base, **top, runtime=runtime, serve=serve)


def _apply_runtime(runtime: ServerConfig, data: dict[str, Any]) -> ServerConfig:
    values = _section(data, "runtime")
    bad = [k for k in values if k in _RUNTIME_SKIP]
    if bad:
        raise ConfigError(f"config: [runtime] {bad[0]} belongs in its own section")
    runtime = _replace(runtime, values, "runtime")
    engine = {**dict(runtime.engine_kwargs), **engine_values(_section(data, "engine"))}
    sections: dict[str, Any] = {"engine_kwargs": engine}
    if isinstance(data.get("cosched"), str):
        try:
            sections["cosched"] = CoScheduleConfig.from_names(data["cosched"])
        except ValueError as exc:
            raise ConfigError(f"config: {exc}") from exc
    if "gpu_tier" in data:
        from ragserve.runtime.config import GpuTierConfig

        tier = dict(_section(data, "gpu_tier"))
        for key in ("generation_profile", "retrieval_profile"):
            if isinstance(tier.get(key), list):  # TOML arrays -> the config's tuples
                tier[key] = tuple(tuple(p) for p in tier[key])
        sections["gpu_tier"] = _replace(runtime.gpu_tier or GpuTierConfig(), tier, "gpu_tier")
    for name in ("cosched", "document_limits", "operators"):
        if name in data and name not in sections:
            sections[name] = _replace(getattr(runtime, name), _section(data, name), name)
    return dataclasses.replace(runtime, **sections)


def engine_values(values: dict[str, Any]) -> dict[str, Any]:
    """``[engine]`` checked against ``EngineConfig``; ``kv_cache_gb`` becomes bytes."""
    out = dict(values)
    if "kv_cache_gb" in out:
        gb = out.pop("kv_cache_gb")
        if not isinstance(gb, (int, float)) or isinstance(gb, bool) or gb <= 0:
            raise ConfigError(f"config: [engine] kv_cache_gb must be a number > 0, got {gb!r}")
        out["kv_cache_bytes"] = int(gb * (1 << 30))
    from ragserve.generation.config import EngineConfig

    keys = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    unknown = sorted(set(out) - set(keys))
    if unknown:
        raise ConfigError(
            f"config: unknown key [engine] {unknown[0]!r}; known: kv_cache_gb, {', '.join(keys)}"
        )
    return out


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"config: [{name}] must be a table of keys, got {value!r}")
    return value


def _replace(obj: Any, values: dict[str, Any], section: str) -> Any:
    """``dataclasses.replace`` with every key and value checked (a ``ConfigError`` names it)."""
    names = {f.name: f for f in dataclasses.fields(obj) if f.name not in _RUNTIME_SKIP}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"config: unknown key [{section}] {key!r}; known: {', '.join(names)}")
        default = getattr(obj, key)
        if not _same_kind(value, default, names[key]):
            raise ConfigError(f"config: [{section}] {key} has the wrong type: {value!r}")
    try:
        return dataclasses.replace(obj, **values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config: [{section}] {exc}") from exc


def _same_kind(value: Any, default: Any, f: dataclasses.Field) -> bool:
    """A loose type check from the field's annotation string (``int | None`` etc.)."""
    for kind, names in _ANNOTATIONS:
        if isinstance(value, kind):
            return any(name in str(f.type) for name in names)
    return default is None or isinstance(value, type(default))


def dump_toml(config: LaunchConfig) -> str:
    """The config as a TOML file ``from_mapping(tomllib.loads(...))`` reads back equal."""
    lines = [_line(k, getattr(config, k)) for k in ("model", "index", "embedder")]
    lines.append(_line("workflows", list(config.workflows)))
    runtime = config.runtime
    fields = [f.name for f in dataclasses.fields(runtime) if f.name not in _RUNTIME_SKIP]
    sections = {
        "engine": dict(runtime.engine_kwargs),
        "runtime": {name: getattr(runtime, name) for name in fields},
    }
    for name in SECTIONS[2:]:
        part = config.serve if name == "serve" else getattr(runtime, name)
        if part is not None:
            sections[name] = dataclasses.asdict(part)
    for name, values in sections.items():
        lines += ["", f"[{name}]", *(_line(k, v) for k, v in values.items())]
    return "\n".join(line for line in lines if line is not None) + "\n"


def _line(key: str, value: Any) -> str | None:
    if value is None:
        return None  # TOML has no null: left out means the default
    return f"{key} = {_toml_value(value)}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"config: cannot write {value!r} to TOML")
