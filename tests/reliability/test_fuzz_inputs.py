"""Bad input fuzzing (hypothesis): training configs, `--set` overrides and inventories (YAML and INI).

Whatever the input, the outcome is a valid config/plan or the one-line error (exit 2 on the command
line), never a traceback and never a hang: every example must finish within LIMIT_S. Most examples
call the parse/validate entry points in-process (fast); a few run the real console scripts under a
timeout. Values come from the schema (plausible and boundary values, wrong types, unknown keys) mixed
with YAML trouble (aliases, recursive aliases, tags, duplicate keys, deep nesting, NaN, bad UTF-8).
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from ddp_train.__main__ import main as train_main
from ddp_train.config import DEFAULT_CONFIG_PATH, Config, ConfigError, dump_yaml, load_config, load_schema
from ddp_train.launch.cli import main as launch_main

BIN = Path(sys.executable).parent
NODNS = Path(__file__).resolve().parent / "nodns"
LIMIT_S = 10.0  # far above any honest parse; a hang or an exponential blow-up exceeds it
FAST = settings(
    max_examples=int(os.environ.get("RL_FUZZ_EXAMPLES", "120")),
    deadline=None,  # timing is asserted per example with LIMIT_S (hypothesis' deadline is flaky on a busy CI)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,  # nothing written into the repository
    # no "explain" phase: it re-runs failures under a line tracer, so LIMIT_S would then misfire
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    # CI sees the same examples every run; RL_FUZZ_EXPLORE=1 RL_FUZZ_EXAMPLES=5000 hunts for new ones
    derandomize=not os.environ.get("RL_FUZZ_EXPLORE"),
)
CLI = settings(FAST, max_examples=int(os.environ.get("RL_FUZZ_CLI_EXAMPLES", "3")))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---- values --------------------------------------------------------------------------------------

# YAML documents or fragments that have broken parsers before: aliases (and an exponential alias
# tree), a recursive alias, python tags, duplicate keys, deep nesting, odd scalars.
NASTY_YAML = [
    "&a [*a]",
    "{a: &x [1, 2], b: *x}",
    "&r {k: *r}",
    "!!python/object/apply:os.system ['true']",
    "!!binary aGVsbG8=",
    "{a: 1, a: 2}",
    "[" * 60 + "]" * 60,
    "[" * 2000 + "]" * 2000,
    "{",
    "'unterminated",
    ".nan",
    "-.inf",
    "1e999",
    "0x1F",
    "0o17",
    "2001-12-14t21:59:43.10-05:00",
    "~",
    "!!set {a, b}",
    "? [complex, key]\n: v",
    "%YAML 1.1\n---\na: 1",
    "--- a\n--- b",
    "\t- tab",
    "key: @reserved",
]


def _bomb(levels: int) -> str:
    """A YAML mapping whose aliases expand to 9**levels scalars (a 'billion laughs' document)."""
    lines = ["l0: &l0 [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(
        ["", "auto", "mlp", "gpt", "plugin", "pkg.mod:fn", "bf16", "sgd", "-1", "1e-3", "6e4", "1_000"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _properties(schema: dict, node: dict) -> dict:
    ref = node.get("$ref")
    if ref:
        node = {**schema["$defs"][ref.split("/")[-1]], **node}
    return node.get("properties", {})


def _plausible(node: dict) -> st.SearchStrategy:
    """Values the schema might accept for one leaf, including its boundaries and just past them."""
    options: list[st.SearchStrategy] = []
    if "enum" in node:
        options.append(st.sampled_from(node["enum"]))
    types = node.get("type", [])
    types = types if isinstance(types, list) else [types]
    lo, hi = (
        node.get("minimum", node.get("exclusiveMinimum")),
        node.get("maximum", node.get("exclusiveMaximum")),
    )
    if "integer" in types:
        edges = [v + d for v in (lo, hi) if v is not None for d in (-1, 0, 1)]
        options.append(st.sampled_from(edges) if edges else st.integers())
        options.append(st.integers(min_value=-5, max_value=100))
    if "number" in types:
        edges = [v * f for v in (lo, hi) if v is not None for f in (0.5, 1, 1.5)] + [0.0, -0.0]
        options.append(st.sampled_from(edges) | st.floats(min_value=-10, max_value=10))
    if "string" in types:
        options.append(st.text(max_size=20) | st.sampled_from(["", "a", "pkg.mod:fn", "default"]))
    if "boolean" in types:
        options.append(st.booleans())
    if "null" in types:
        options.append(st.none())
    if "array" in types:
        options.append(st.lists(st.floats(min_value=-1, max_value=2), max_size=3))
    return st.one_of(options) if options else values


def _section(schema: dict, node: dict) -> st.SearchStrategy:
    props = _properties(schema, node)
    if not props:
        return _plausible(node) | values
    known = {k: _section(schema, v) for k, v in props.items()}
    keys = st.sampled_from(sorted(known)) | st.text(max_size=12)
    return (
        st.dictionaries(keys, st.just(None), max_size=4).flatmap(
            lambda d: st.fixed_dictionaries({k: known.get(k, values) for k in d})
        )
        | values
    )


SCHEMA = load_schema()
config_docs = _section(SCHEMA, SCHEMA)


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A config file: a schema-shaped document, sometimes spliced with YAML trouble, or raw text."""
    kind = draw(st.sampled_from(["doc", "doc", "doc", "spliced", "raw"]))
    if kind == "raw":
        return draw(st.text(max_size=200))
    text = yaml.safe_dump(draw(config_docs), allow_unicode=draw(st.booleans()))
    if kind == "spliced":
        lines = text.splitlines() or [""]
        at = draw(st.integers(0, len(lines)))
        key = draw(st.sampled_from(["", "model:\n  plugin_args:\n    x: ", "train:\n  lr: ", "seed: "]))
        lines.insert(at, key + draw(st.sampled_from(NASTY_YAML)))
        text = "\n".join(lines)
    return text


# ---- the properties ------------------------------------------------------------------------------


def check_config(call, scratch: Path) -> ConfigError | None:  # noqa: ANN001
    """call() must return a Config, or raise ConfigError as one short line; either way quickly.

    A config that loads must also survive what the trainer does with it: written out as config.yaml
    (dump_yaml), that file loads back to the same config.
    """
    t0 = time.monotonic()
    try:
        cfg = call()
    except ConfigError as e:
        assert time.monotonic() - t0 < LIMIT_S, f"took {time.monotonic() - t0:.1f}s"
        msg = str(e)
        assert "\n" not in msg and "\r" not in msg, msg
        return e
    assert time.monotonic() - t0 < LIMIT_S, f"took {time.monotonic() - t0:.1f}s"
    assert isinstance(cfg, Config)
    dumped = scratch / "config.yaml"
    dumped.write_text(dump_yaml(cfg), encoding="utf-8")
    assert load_config(str(dumped)) == cfg, dumped.read_text()
    return None


@pytest.mark.slow
@FAST
@given(text=config_texts())
def test_config_file_is_valid_or_one_line_error(scratch: Path, text: str) -> None:
    path = scratch / "train.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    err = check_config(lambda: load_config(str(path)), scratch)
    assert err is None or (err.source == str(path) and len(str(err)) < 1000), str(err)


@pytest.mark.parametrize(
    "data",
    [
        b"model:\n  plugin_args:\n    a: &a [*a]\n",  # a recursive alias
        ("model:\n  plugin_args:\n    " + _bomb(9).replace("\n", "\n    ") + "\n").encode(),  # 387M scalars
        b"train:\n  betas: &b [0.9, *b]\n",
        b"\xff\xfe not utf-8\n",
    ],
    ids=["recursive-alias", "alias-bomb", "recursive-in-list", "bad-utf8"],
)
@pytest.mark.timeout(60)  # an exponential expansion would run for hours: fail instead
def test_config_yaml_traps_are_one_line_errors(scratch: Path, data: bytes) -> None:
    path = scratch / "trap.yaml"
    path.write_bytes(data)
    err = check_config(lambda: load_config(str(path)), scratch)
    assert err is not None and err.source == str(path), f"accepted: {data[:80]!r}"


def _dotted(schema: dict, node: dict, prefix: str = "") -> list[str]:
    out = []
    for key, sub in _properties(schema, node).items():
        path = f"{prefix}{key}"
        out.append(path)
        out += _dotted(schema, sub, path + ".")
    return out


DOTTED = _dotted(SCHEMA, SCHEMA)
override_keys = st.one_of(
    st.sampled_from(DOTTED),
    st.sampled_from(DOTTED).map(lambda k: k + ".x"),
    st.sampled_from(["model.plugin_args.lr", "data.plugin_args.n", "", ".", "a..b", " train.lr ", "=", "x"]),
    st.text(max_size=15),
)
override_values = st.one_of(
    st.text(max_size=20),
    st.sampled_from(NASTY_YAML),
    scalars.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()),
)
overrides = st.lists(
    st.one_of(st.tuples(override_keys, override_values).map("=".join), st.text(max_size=20)), max_size=4
)


@FAST
@given(items=overrides)
@example(items=['run.dir="6e4"', 'run.name="1e5"'])  # strings the loader would read back as floats
def test_set_overrides_are_valid_or_one_line_error(scratch: Path, items: list[str]) -> None:
    err = check_config(lambda: load_config(None, items), scratch)
    # the error names the offending --set (or the packaged default file a --set conflicts with)
    assert err is None or err.source in [f"--set {i}" for i in items] + [str(DEFAULT_CONFIG_PATH)], str(err)


@CLI
@given(text=config_texts(), items=overrides)
def test_ddp_train_command_line(scratch: Path, text: str, items: list[str]) -> None:
    path = scratch / "cli.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    args = [str(BIN / "ddp-train"), "--config", str(path), "--print-config"]
    for item in items:
        args += ["--set", item]
    res = subprocess.run(args, capture_output=True, text=True, timeout=60, errors="replace")
    assert_exit_0_or_one_line_2(res, "ddp-train: error: ")


def assert_exit_0_or_one_line_2(res: subprocess.CompletedProcess, prefix: str) -> None:
    assert res.returncode in (0, 2), (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    if res.returncode == 2:
        assert res.stderr.count("\n") == 1 and res.stderr.startswith(prefix), res.stderr


@FAST
@given(argv=st.lists(st.sampled_from(["--config", "--set", "--print-config", "-h", "--", "x=1", "/no/such"])
                     | st.text(max_size=10), max_size=5))  # fmt: skip
def test_ddp_train_argv_is_usage_or_one_line(argv: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = train_main([*argv, "--print-config"])
        except SystemExit as e:
            code = e.code
    assert code in (0, 2), (code, err.getvalue())
    if code == 2:
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("ddp-train: error: "), (
            err.getvalue()
        )


# ---- inventories ---------------------------------------------------------------------------------

host_names = st.one_of(
    st.sampled_from(
        ["node0", "node1", "gpu-a", "gpu[01:03]", "10.0.0.5", "localhost", "h;rm -rf /", "$(x)", "a b"]
    ),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12),
)
IP_LIKE = st.sampled_from(["10.0.0.1", "10.0.0.2", "127.0.0.1", "::1", "192.168.1.300", "", "999.1.1.1"])
VAR_NAMES = [
    "ansible_host", "ansible_port", "ansible_user", "ansible_connection", "ansible_ssh_common_args",
    "ansible_ssh_private_key_file", "ddp_master_port", "ddp_nproc_per_node", "ddp_env", "ddp_venv",
    "ddp_workdir", "ddp_master", "ddp_master_addr", "ddp_known_hosts_file", "ansible_password",
]  # fmt: skip
var_values = st.one_of(
    IP_LIKE,
    values,
    st.sampled_from([
        "local", "ssh", "docker", 22, 0, 65536, "29500", -1, "gpu", "auto", 1.5, True,
        "{{ undefined_var }}", "{{ ansible_host }}", "{{ ddp_venv }}", "{{ 1 / 0 }}", "{% if %}", "{{",
        "-o ProxyCommand='nc %h %p'", "-o 'unbalanced", "-J user@jump:2222", "$(touch /tmp/x)", "a\nb",
        {"HF_TOKEN": "s3cret", "1BAD": "x"}, {"OK": ["list"]}, {"OK": "v", "EMPTY": ""},
    ]),
)  # fmt: skip
host_vars = st.dictionaries(st.sampled_from(VAR_NAMES) | st.text(max_size=8), var_values, max_size=4)


@st.composite
def yaml_inventories(draw: st.DrawFn) -> str:
    """Inventory-shaped YAML (hypothesis shrinks towards the first choices: the plausible ones)."""
    hosts = draw(st.dictionaries(host_names, st.none() | host_vars, min_size=1, max_size=3))
    base = draw(st.sampled_from([{"ansible_host": "10.0.0.1"}, {"ansible_connection": "local"}, {}]))
    group = {"hosts": hosts, "vars": {**base, **draw(host_vars)}}
    doc: object = {"all": {"children": {draw(st.sampled_from(["gpu_nodes", "other", "all"])): group}}}
    if draw(st.integers(0, 5)) == 5:
        doc = draw(values)  # not even an inventory shape
    text = yaml.safe_dump(doc, allow_unicode=True)
    if draw(st.integers(0, 4)) == 4:
        lines = text.splitlines() or [""]
        lines.insert(draw(st.integers(0, len(lines))), "      ddp_env: " + draw(st.sampled_from(NASTY_YAML)))
        text = "\n".join(lines)
    return text


ini_tokens = st.one_of(
    st.sampled_from(["'", '"', "=", "[", "]", ":", "#", ";", "\\", "{{", "}}", " ", "a=b=c", "x='y z'"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x00"), max_size=8),
)


@st.composite
def ini_inventories(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["group", "vars", "children", "host", "host", "var", "junk"]))
        name = draw(st.sampled_from(["gpu_nodes", "all", "other", "bad name", ""]) | st.text(max_size=6))
        if kind == "group":
            lines.append(f"[{name}]")
        elif kind in ("vars", "children"):
            lines.append(f"[{name}:{kind}]")
        elif kind == "host":
            pairs = draw(st.lists(st.tuples(st.sampled_from(VAR_NAMES), var_values.map(str)), max_size=3))
            lines.append(" ".join([draw(host_names).replace("\n", " ")] + [f"{k}={v}" for k, v in pairs]))
        elif kind == "var":
            value = (str(draw(var_values)).splitlines() or [""])[0]
            lines.append(f"{draw(st.sampled_from(VAR_NAMES))}={value}")
        else:
            lines.append("".join(draw(st.lists(ini_tokens, max_size=5))))
    return "\n".join(lines) + "\n"


def _no_dns(host, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    name = host.decode() if isinstance(host, bytes) else host
    if name not in (None, "localhost"):
        try:
            ipaddress.ip_address(name)
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (test: no DNS)") from None
    return _real_getaddrinfo(host, *args, **kwargs)


_real_getaddrinfo = socket.getaddrinfo


def launch_dry_run(path: Path) -> tuple[int, str, str]:
    """ddp-launch --dry-run in this process; real files as stdout/stderr, as Ansible's display expects."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with (
            mock.patch("socket.getaddrinfo", _no_dns),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = launch_main(["--hosts", str(path), "--job-id", "fuzz", "--dry-run"])
            except SystemExit as e:
                code = e.code
        out.seek(0), err.seek(0)
        texts = out.read(), err.read()
    assert time.monotonic() - t0 < LIMIT_S, f"took {time.monotonic() - t0:.1f}s"
    return code, *texts


def assert_plan_or_one_line(code: int, out: str, err: str) -> None:
    assert code in (0, 2), (code, err)
    if code == 0:
        assert out.startswith("# job fuzz: ") and "torchrun" in out, out
    else:
        assert err.count("\n") == 1 and err.startswith("ddp-launch: error: "), err
        # the auto plugin's "not a plugin config" is never the reason given for an ordinary inventory
        assert "no root 'plugin' key" not in err, err


@pytest.mark.slow
@FAST
@given(text=yaml_inventories())
def test_yaml_inventory_is_a_plan_or_one_line_error(scratch: Path, text: str) -> None:
    path = scratch / "inv.yml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    assert_plan_or_one_line(*launch_dry_run(path))


@FAST
@given(text=ini_inventories())
def test_ini_inventory_is_a_plan_or_one_line_error(scratch: Path, text: str) -> None:
    path = scratch / "hosts"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    assert_plan_or_one_line(*launch_dry_run(path))


@pytest.mark.slow
@CLI
@given(yml=yaml_inventories(), ini=ini_inventories())
def test_ddp_launch_command_line(scratch: Path, yml: str, ini: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(NODNS)}
    for name, text in (("cli.yml", yml), ("cli-hosts", ini)):
        path = scratch / name
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        res = subprocess.run(
            [str(BIN / "ddp-launch"), "--hosts", str(path), "--job-id", "fuzz", "--dry-run"],
            capture_output=True, text=True, timeout=60, env=env, errors="replace",
        )  # fmt: skip
        assert_exit_0_or_one_line_2(res, "ddp-launch: error: ")
