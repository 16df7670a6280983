"""Typed training config: YAML file + `--set` overrides, validated by schemas/train.schema.json.

Imports neither torch nor anything heavy, so a bad config is refused in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ddp_train.errors import UserError
from ddp_train.text import short

PACKAGE_DIR = Path(__file__).resolve().parent
SCHEMA_PATH = PACKAGE_DIR / "schemas" / "train.schema.json"
DEFAULT_CONFIG_PATH = PACKAGE_DIR / "configs" / "default.yaml"


class ConfigError(UserError):
    """A bad config value or input file: one line `<source>: <field>: <message>`."""


@dataclass
class RunConfig:
    name: str = "default"
    dir: str = "runs"


@dataclass
class MLPConfig:
    in_dim: int = 32
    hidden_dim: int = 128
    n_layers: int = 2
    n_classes: int = 8
    dropout: float = 0.0


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    vocab_size: int | str = 64  # or "auto": meta.json's vocab_size (resolved by data.resolve_vocab)
    dropout: float = 0.0
    bias: bool = False


@dataclass
class ModelConfig:
    name: str = "mlp"
    plugin: str | None = None
    plugin_args: dict = field(default_factory=dict)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    gpt: GPTConfig = field(default_factory=GPTConfig)


@dataclass
class SyntheticConfig:
    num_samples: int = 1024
    val_samples: int = 256


@dataclass
class TokensConfig:
    path: str | None = None
    val_path: str | None = None


@dataclass
class EvalConfig:
    interval_steps: int = 10
    batches: int = 4
    keep_best: bool = True


@dataclass
class DataConfig:
    name: str = "synthetic"
    plugin: str | None = None
    plugin_args: dict = field(default_factory=dict)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    num_workers: int = 0
    prefetch_factor: int = 2


@dataclass
class OptimConfig:
    max_steps: int = 40
    batch_size: int = 32
    grad_accum_steps: int = 1
    global_batch: int | str | None = None  # or "auto": the checkpoint's (trainer, batchplan.py)
    optimizer: str = "adamw"
    lr: float = 0.003
    min_lr: float = 0.0003
    warmup_steps: int = 5
    decay_steps: int | None = None
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9
    grad_clip: float = 1.0
    precision: str = "fp32"
    compile: bool = False
    gc_interval_steps: int = 50


@dataclass
class CheckpointConfig:
    dir: str | None = None
    interval_steps: int = 10
    keep_latest_k: int = 3
    resume: str = "auto"
    io_timeout_s: float = 1800.0
    replicas: int = 1
    async_save: bool = True  # rank 0 writes in a thread after a copy to host memory (asyncsave.py)
    at_end: bool = True  # false: no save when max_steps is reached (a stop still saves)


@dataclass
class DistConfig:
    backend: str = "auto"
    device: str = "auto"
    init_timeout_s: float = 300.0
    collective_timeout_s: float = 300.0
    compile_timeout_s: float = 1800.0
    bucket_cap_mb: float = 25.0  # DDP's gradient buckets (torch's default 25)


@dataclass
class LogConfig:
    interval_steps: int = 10
    jsonl: bool = True
    level: str = "info"
    progress: str = "auto"
    peak_tflops: float | None = None
    tensorboard: bool = False
    prometheus: bool = False
    prometheus_textfile: str = "/var/lib/prometheus/node-exporter/ddp_train-{user}-{run}.prom"


@dataclass
class DebugConfig:
    step_delay_s: float = 0.0
    save_delay_s: float = 0.0
    dump_indices: bool = False


@dataclass
class Config:
    """The whole training config; section by section as in the schema."""

    run: RunConfig = field(default_factory=RunConfig)
    seed: int = 1337
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the config (YAML/JSON/checkpoint friendly)."""
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> Path:
        """The run's directory, resolved against the current working directory."""
        return (Path(self.run.dir).expanduser() / self.run.name).resolve()

    @property
    def checkpoint_dir(self) -> Path:
        """Checkpoint directory: checkpoint.dir, or <run dir>/checkpoints."""
        if self.checkpoint.dir:
            return Path(self.checkpoint.dir).expanduser().resolve()
        return self.run_dir / "checkpoints"


# --- YAML ---------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `6e-4` as a float (YAML 1.2) and refuses duplicate keys."""


_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings _Loader reads as floats (`6e4`), so what it writes loads back."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _construct_map(loader: _Loader, node: yaml.MappingNode):
    seen: set = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode):
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                )
            seen.add(key)
    yield from yaml.SafeLoader.construct_yaml_map(loader, node)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    return f"invalid YAML: {where}{problem}"


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text with the config loader; errors become ConfigError(source)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(source, None, _yaml_error(exc)) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(source, None, f"invalid YAML: {exc}") from None


def _reject_cycles(data: Any, source: str, parts: tuple = ()) -> None:
    """Refuse self-referencing YAML aliases (`a: &x [*x]`), absurd nesting and alias bombs (a few lines
    of nested aliases that expand to billions of values), which no config needs."""
    try:
        _walk_cycles(data, source, parts, (), [MAX_VALUES])
    except RecursionError:
        raise ConfigError(source, None, "nesting too deep") from None


MAX_DEPTH = 16  # the schema needs 3 levels; plug-in arguments get some room, not unbounded
MAX_VALUES = 100_000  # values once aliases are expanded; every later pass (schema, copies) walks them all


def _walk_cycles(data: Any, source: str, parts: tuple, stack: tuple, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(source, _path(parts), f"more than {MAX_VALUES} values after expanding YAML aliases")
    if isinstance(data, (dict, list)):
        if len(stack) >= MAX_DEPTH:
            raise ConfigError(source, _path(parts), f"nested deeper than {MAX_DEPTH} levels")
        if id(data) in stack:
            raise ConfigError(source, _path(parts), "recursive YAML alias")
        items = data.items() if isinstance(data, dict) else enumerate(data)
        for key, value in items:
            _walk_cycles(value, source, (*parts, key), (*stack, id(data)), budget)


MAX_CONFIG_BYTES = 1 << 20


def _read_file(path: str) -> dict:
    try:
        if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
            raise ConfigError(path, None, "not a regular file")  # a FIFO or device could block forever
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(path, None, f"larger than {MAX_CONFIG_BYTES} bytes; not a config file")
    except FileNotFoundError:
        raise ConfigError(path, None, "no such file") from None
    except IsADirectoryError:
        raise ConfigError(path, None, "is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(path, None, "not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(path, None, f"cannot read: {exc.strerror or exc}") from None
    data = parse_yaml(text, path)
    if data is None:
        return {}
    _reject_cycles(data, path)
    if not isinstance(data, dict):
        raise ConfigError(path, None, f"expected a mapping of sections at the top level, got {_kind(data)}")
    return data


# --- schema -------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The JSON Schema of the config (package data)."""
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)


def _validator() -> jsonschema.protocols.Validator:
    schema = load_schema()
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        merged = dict(schema["$defs"][ref.split("/")[-1]])
        merged.update({k: v for k, v in node.items() if k != "$ref"})
        return merged
    return node


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _schema_message(err: jsonschema.ValidationError) -> tuple[str, str]:
    """(field, message) for one schema error, short and single-line."""
    where = _path(err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(
            (k for k in err.instance if k not in allowed), key=lambda k: (not isinstance(k, str), str(k))
        )
        key = extra[0] if extra else "?"
        field_name = f"{where}.{key}" if err.absolute_path else str(key)
        hint = f" (known: {', '.join(allowed)})" if allowed else " (keys must be identifiers)"
        return field_name, f"unknown key{hint}"
    if err.validator == "enum":
        return where, f"{short(err.instance)} is not one of {', '.join(map(repr, err.validator_value))}"
    if err.validator == "type":
        types = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        return where, f"{short(err.instance)} is not of type {' or '.join(map(repr, types))}"
    if err.validator == "pattern" and "plugin" in where:
        return where, f"{short(err.instance)} is not a 'package.module:function' reference"
    message = err.message
    if len(message) > 200:
        message = message.replace(repr(err.instance), short(err.instance))
    return where, message


def _check_finite(data: Any, parts: tuple = ()) -> tuple[tuple, str] | None:
    if isinstance(data, float) and not math.isfinite(data):
        return parts, f"{data!r} is not a finite number"
    if isinstance(data, dict):
        for k, v in data.items():
            found = _check_finite(v, (*parts, k))
            if found:
                return found
    if isinstance(data, list):
        for i, v in enumerate(data):
            found = _check_finite(v, (*parts, i))
            if found:
                return found
    return None


# --- overrides ----------------------------------------------------------------------------------


def _parse_override(item: str) -> tuple[list[str], Any]:
    source = f"--set {item}"
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(source, None, "expected KEY=VALUE, e.g. --set train.lr=0.001")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(source, key, "empty key component")
    value = parse_yaml(raw, source) if raw.strip() else None
    _reject_cycles(value, source, tuple(parts))
    return parts, value


def _check_known(parts: list[str], source: str) -> None:
    schema = load_schema()
    node: dict = schema
    for i, part in enumerate(parts):
        node = _resolve(schema, node)
        here = ".".join(parts[: i + 1])
        props = node.get("properties")
        if props is not None and part in props:
            node = props[part]
            continue
        patterns = node.get("patternProperties")
        if patterns and any(re.match(p, part) for p in patterns):
            return  # free-form plug-in arguments
        if props is None and not patterns:
            parent = ".".join(parts[:i])
            raise ConfigError(source, here, f"unknown key ({parent} is a value, not a section)")
        known = f" (known: {', '.join(sorted(props))})" if props else " (keys must be identifiers)"
        raise ConfigError(source, here, f"unknown key{known}")


def _assign(data: dict, parts: list[str], value: Any, file_source: str) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(file_source, ".".join(parts[: i + 1]), f"{short(child)} is not a mapping")
        node = child
    node[parts[-1]] = value


# --- typed object -------------------------------------------------------------------------------


def _build(cls: type, data: dict) -> Any:
    obj = cls()
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        default = getattr(obj, f.name)
        value = data[f.name]
        if dataclasses.is_dataclass(default):
            value = _build(type(default), value or {})
        elif isinstance(value, float) and isinstance(default, int) and not isinstance(default, bool):
            value = int(value)  # JSON Schema counts 10.0 as an integer
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        setattr(obj, f.name, value)
    return obj


def _semantic_checks(cfg: Config) -> list[tuple[str, str, str]]:
    """Cross-field rules the schema cannot express: (field, other field involved, message)."""
    out: list[tuple[str, str, str]] = []
    for section in ("model", "data"):
        sec = getattr(cfg, section)
        name, plugin = f"{section}.name", f"{section}.plugin"
        if sec.name == "plugin" and not sec.plugin:
            out.append((plugin, name, f"required when {name} is 'plugin'"))
        if sec.plugin and sec.name != "plugin":
            out.append((name, plugin, f"must be 'plugin' when {plugin} is set"))
    gpt = cfg.model.gpt
    if gpt.vocab_size == "auto" and cfg.model.name == "gpt" and cfg.data.name != "tokens":
        out.append(
            ("model.gpt.vocab_size", "data.name", "'auto' needs data.name 'tokens' (a prepared directory)")
        )
    if cfg.model.name == "gpt" and gpt.n_embd % gpt.n_head:
        out.append(("model.gpt.n_head", "model.gpt.n_embd", f"must divide model.gpt.n_embd ({gpt.n_embd})"))
    if cfg.data.name == "tokens" and not cfg.data.tokens.path:
        out.append(("data.tokens.path", "data.name", "required when data.name is 'tokens'"))
    if cfg.data.name == "tokens" and cfg.model.name == "mlp":
        out.append(
            ("data.name", "model.name", "'tokens' needs a language model (model.name 'gpt' or 'plugin')")
        )
    if cfg.train.min_lr > cfg.train.lr:
        out.append(
            ("train.min_lr", "train.lr", f"{cfg.train.min_lr} is greater than train.lr ({cfg.train.lr})")
        )
    decay = cfg.train.decay_steps
    if decay is not None and decay < cfg.train.warmup_steps:
        out.append(("train.decay_steps", "train.warmup_steps", f"{decay} is less than train.warmup_steps"))
    return out


def load_config(path: str | None = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Read, override, validate and type a config; raise ConfigError on any bad input."""
    source = path if path is not None else str(DEFAULT_CONFIG_PATH)
    data = _read_file(source)
    origins: dict[tuple, str] = {}
    for item in overrides:
        parts, value = _parse_override(item)
        _check_known(parts, f"--set {item}")
        _assign(data, parts, value, source)
        origins[tuple(parts)] = f"--set {item}"

    def origin(parts: tuple) -> str:
        for n in range(len(parts), 0, -1):
            if parts[:n] in origins:
                return origins[parts[:n]]
        return source

    try:
        return _validate(data, source, origin)
    except RecursionError:
        raise ConfigError(source, None, "nesting too deep") from None


def _validate(data: dict, source: str, origin: Any) -> Config:
    errors = sorted(
        _validator().iter_errors(data),
        key=lambda e: (origin(tuple(e.absolute_path)) != source, [str(p) for p in e.absolute_path]),
    )
    if errors:
        err = errors[0]
        where, message = _schema_message(err)
        raise ConfigError(origin(tuple(err.absolute_path)), where, message)
    bad = _check_finite(data)
    if bad:
        raise ConfigError(origin(bad[0]), _path(bad[0]), bad[1])
    cfg = _build(Config, data)
    problems = _semantic_checks(cfg)
    if problems:
        where, other, message = problems[0]
        src = origin(tuple(where.split(".")))
        if src == source:
            src = origin(tuple(other.split(".")))
        raise ConfigError(src, where, message)
    return cfg


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what --print-config shows)."""
    return yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=None)
