"""Training config: schema and dataclasses agree, files and --set load, bad input is one line + exit 2."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp_train.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    dump_yaml,
    load_config,
    load_schema,
)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_train", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- schema <-> dataclasses ------------------------------------------------------------------------


def _walk(schema: dict, node: dict, obj: object, prefix: str = ""):
    if "$ref" in node:
        node = {**schema["$defs"][node["$ref"].split("/")[-1]], **node}
    for key, sub in node.get("properties", {}).items():
        yield f"{prefix}{key}", sub, getattr(obj, key)


def test_schema_and_dataclasses_describe_the_same_keys_and_defaults():
    schema = load_schema()

    def check(node: dict, obj: object, prefix: str) -> None:
        names = {f.name for f in dataclasses.fields(obj)}
        assert names == set(node["properties"]), f"{prefix or 'top level'}: schema and dataclass differ"
        assert node.get("additionalProperties") is False, f"{prefix}: additionalProperties must be false"
        for path, sub, value in _walk(schema, node, obj, prefix):
            if dataclasses.is_dataclass(value):
                check(sub, value, path + ".")
            else:
                resolved = {**schema["$defs"][sub["$ref"].split("/")[-1]], **sub} if "$ref" in sub else sub
                assert "default" in resolved, f"{path}: no default in the schema"
                assert resolved["default"] == value, (
                    f"{path}: schema default {resolved['default']!r} != {value!r}"
                )
                assert resolved.get("description"), f"{path}: undocumented"

    check(schema, Config(), "")


def test_packaged_default_config_is_the_dataclass_default():
    assert load_config(None) == Config()
    assert load_config(str(DEFAULT_CONFIG_PATH)) == Config()


# --- valid input -------------------------------------------------------------------------------------


def test_partial_file_and_overrides(tmp_path):
    path = write(
        tmp_path,
        """
        model:
          name: gpt
          gpt: {n_layer: 3}
        train:
          lr: 6e-4          # YAML 1.1 would read this as a string
          max_steps: 12.0   # an integral float is an integer
        """,
    )
    cfg = load_config(str(path), ["train.lr=1e-3", "model.gpt.n_head=2", "data.plugin_args.k=[1, 2]"])
    assert cfg.model.name == "gpt" and cfg.model.gpt.n_layer == 3 and cfg.model.gpt.n_head == 2
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.max_steps == 12 and isinstance(cfg.train.max_steps, int)
    assert cfg.data.plugin_args == {"k": [1, 2]}
    assert cfg.model.mlp == Config().model.mlp  # untouched sections keep their defaults


def test_empty_file_means_all_defaults(tmp_path):
    assert load_config(str(write(tmp_path, ""))) == Config()


def test_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.dir=out", "run.name=r1"])
    assert cfg.run_dir == tmp_path / "out" / "r1"
    assert cfg.checkpoint_dir == tmp_path / "out" / "r1" / "checkpoints"
    assert load_config(None, ["checkpoint.dir=ck"]).checkpoint_dir == tmp_path / "ck"


def test_print_config_round_trips(tmp_path):
    proc = cli("--print-config", "--set", "train.lr=0.01", "--set", "model.name=gpt")
    assert proc.returncode == 0, proc.stderr
    again = write(tmp_path, proc.stdout)
    assert load_config(str(again)) == load_config(None, ["train.lr=0.01", "model.name=gpt"])
    assert yaml.safe_load(dump_yaml(Config()))["train"]["lr"] == Config().train.lr


# --- bad input: through the CLI, one line, exit 2, no traceback -------------------------------------

BAD_FILES = {
    "unknown_key": ("train:\n  lr: 0.1\n  learning_rate: 0.1\n", "train.learning_rate: unknown key"),
    "unknown_section": ("trian:\n  lr: 0.1\n", "trian: unknown key"),
    "wrong_type": ("train:\n  lr: abc\n", "train.lr: 'abc' is not of type 'number'"),
    "wrong_type_bool": ("train:\n  max_steps: true\n", "train.max_steps: True is not of type 'integer'"),
    "out_of_range": ("train:\n  batch_size: 0\n", "train.batch_size: 0 is less than the minimum of 1"),
    "bad_enum": ("train:\n  precision: fp8\n", "train.precision: 'fp8' is not one of 'fp32', 'bf16', 'fp16'"),
    "section_not_mapping": ("train: 5\n", "train: 5 is not of type 'object'"),
    "bad_yaml": ("train:\n  lr: [1, 2\n", "invalid YAML: line 3"),
    "bad_yaml_indent": ("train:\n  lr: 1\n batch_size: 2\n", "invalid YAML: line"),
    "duplicate_key": ("train:\n  lr: 1\n  lr: 2\n", "invalid YAML: line 3 column 3: duplicate key 'lr'"),
    "top_level_list": ("- 1\n- 2\n", "expected a mapping of sections at the top level, got a list"),
    "nan": ("train:\n  lr: .nan\n", "train.lr: nan is not a finite number"),
    "plugin_ref": ("model:\n  name: plugin\n  plugin: not a ref\n", "model.plugin: 'not a ref' is not a"),
    "plugin_missing": ("model:\n  name: plugin\n", "model.plugin: required when model.name is 'plugin'"),
    "plugin_args_key": (
        "model:\n  plugin_args: {'not-an-identifier': 1}\n",
        "model.plugin_args.not-an-identifier",
    ),
    "heads": ("model:\n  name: gpt\n  gpt: {n_head: 3, n_embd: 64}\n", "model.gpt.n_head: must divide"),
    "min_lr": ("train:\n  lr: 0.001\n  min_lr: 0.01\n", "train.min_lr: 0.01 is greater than train.lr"),
    "tokens_without_path": ("model: {name: gpt}\ndata: {name: tokens}\n", "data.tokens.path: required"),
    "recursive_alias": ("model:\n  plugin_args: &a {k: *a}\n", "model.plugin_args.k: recursive YAML alias"),
    "too_deep": (
        "model:\n  plugin_args:\n    k: " + "[" * 40 + "]" * 40 + "\n",
        "nested deeper than 16 levels",
    ),
    "replicas_negative": (
        "checkpoint:\n  replicas: -1\n",
        "checkpoint.replicas: -1 is less than the minimum of 0",
    ),
    "replicas_word": (
        "checkpoint:\n  replicas: two\n",
        "checkpoint.replicas: 'two' is not of type 'integer'",
    ),
    "very_deep": ("x: " + "[" * 3000 + "]" * 3000 + "\n", "invalid YAML: maximum recursion depth exceeded"),
}


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddp-train: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert proc.stdout == ""


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_one_line_naming_file_and_field(tmp_path, case):
    text, expected = BAD_FILES[case]
    path = write(tmp_path, text)
    assert_one_line_error(cli("--config", str(path)), f"ddp-train: error: {path}: ", expected)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert_one_line_error(cli("--config", str(missing)), f"{missing}: no such file")


def test_devices_fifos_and_huge_files_are_refused_without_reading_them(tmp_path):
    assert_one_line_error(cli("--config", "/dev/zero"), "/dev/zero: not a regular file")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would block forever
    assert_one_line_error(cli("--config", str(fifo)), f"{fifo}: not a regular file")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    assert_one_line_error(cli("--config", str(big)), "not a config file")


def test_directory_and_binary_file(tmp_path):
    assert_one_line_error(cli("--config", str(tmp_path)), f"{tmp_path}: is a directory")
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(cli("--config", str(binary)), f"{binary}: ")


BAD_SETS = {
    "train.foo=1": "--set train.foo=1: train.foo: unknown key",
    "trian.lr=1": "--set trian.lr=1: trian: unknown key",
    "train.lr=abc": "--set train.lr=abc: train.lr: 'abc' is not of type 'number'",
    "train.lr.x=1": "--set train.lr.x=1: train.lr.x: unknown key (train.lr is a value, not a section)",
    "train.lr": "--set train.lr: expected KEY=VALUE",
    "=1": "--set =1: expected KEY=VALUE",
    "train..lr=1": "--set train..lr=1: train..lr: empty key component",
    "train.lr=[1": "--set train.lr=[1: invalid YAML",
    "train.lr=": "--set train.lr=: train.lr: None is not of type 'number'",
    "model.name=plugin": "--set model.name=plugin: model.plugin: required when model.name is 'plugin'",
}


@pytest.mark.parametrize("item", sorted(BAD_SETS))
def test_bad_set_is_one_line_naming_set_and_field(item):
    assert_one_line_error(cli("--set", item), BAD_SETS[item])


def test_bad_command_line_is_one_line():
    assert_one_line_error(cli("--set"), "argument --set: expected one argument")
    assert_one_line_error(cli("--bogus"), "unrecognized arguments: --bogus")


def test_plugin_that_cannot_be_imported_is_one_line(tmp_path):
    proc = cli("--set", "model.name=plugin", "--set", "model.plugin=no_such_pkg.mod:build", cwd=tmp_path)
    assert_one_line_error(proc, "model.plugin: cannot import 'no_such_pkg.mod'")


# --- fuzz: anything either loads or is refused with ConfigError ------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8)
)
_keys = st.sampled_from(["run", "train", "model", "lr", "max_steps", "gpt", "n_head", "name", "x", "plugin"])
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.dictionaries(_keys, _values, max_size=5), override=st.text(max_size=20))
def test_fuzzed_configs_load_or_raise_config_error(tmp_path_factory, data, override):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    for overrides in ([], [override]):
        try:
            cfg = load_config(str(path), overrides)
        except ConfigError as exc:
            assert "\n" not in str(exc)
        else:
            assert isinstance(cfg, Config)
