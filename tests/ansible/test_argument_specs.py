"""Every role's defaults and meta/argument_specs.yml describe the same variables, the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if (p / "tasks" / "main.yml").exists())
SPEC_TYPES = {"str", "int", "bool", "list", "dict", "path", "float", "raw"}
PY_TYPES = {"str": str, "int": int, "bool": bool, "list": list, "dict": dict, "path": str, "float": float}


def _load(role: str) -> tuple[dict, dict]:
    defaults = yaml.safe_load((ROLES_DIR / role / "defaults" / "main.yml").read_text()) or {}
    specs = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())
    return defaults, specs["argument_specs"]["main"].get("options", {})


def test_every_role_is_checked():
    assert set(ROLES) >= {"cluster_hosts", "firewall", "nvidia_driver", "cuda_toolkit", "nccl", "pytorch"}


@pytest.mark.parametrize("role", ROLES)
def test_defaults_and_argument_specs_have_the_same_keys(role):
    defaults, options = _load(role)
    assert sorted(defaults) == sorted(options), (
        f"roles/{role}: only in defaults {sorted(set(defaults) - set(options))}, "
        f"only in argument_specs {sorted(set(options) - set(defaults))}"
    )


@pytest.mark.parametrize("role", ROLES)
def test_every_variable_is_prefixed_typed_and_described(role):
    defaults, options = _load(role)
    for name, spec in options.items():
        assert name.startswith(f"{role}_"), f"roles/{role}: {name} lacks the role prefix"
        assert spec.get("type") in SPEC_TYPES, f"roles/{role}: {name} has no valid type"
        assert spec.get("description"), f"roles/{role}: {name} has no description"
        if "choices" in spec:
            assert defaults[name] in spec["choices"], f"roles/{role}: default of {name} is not a choice"


@pytest.mark.parametrize("role", ROLES)
def test_documented_defaults_equal_the_real_ones(role):
    """A literal default is repeated in the spec; a templated one is explained in words, not misquoted."""
    defaults, options = _load(role)
    for name, spec in options.items():
        value = defaults[name]
        if "{{" in str(value):
            assert "default" not in spec, f"roles/{role}: {name} is templated; its spec quotes no default"
            continue
        assert "default" in spec, f"roles/{role}: {name} has a literal default; put it in the spec"
        assert spec["default"] == value, f"roles/{role}: {name} spec default {spec['default']!r} != {value!r}"
        assert isinstance(value, PY_TYPES[spec["type"]]), f"roles/{role}: {name} is not a {spec['type']}"


@pytest.mark.parametrize("role", ROLES)
def test_readme_has_the_sections_and_every_variable(role):
    readme = (ROLES_DIR / role / "README.md").read_text()
    for section in ("## Requirements", "## Role Variables", "## Dependencies", "## Example Playbook"):
        assert section in readme, f"roles/{role}/README.md lacks {section}"
    defaults, _ = _load(role)
    missing = [name for name in defaults if name not in readme]
    assert not missing, f"roles/{role}/README.md does not mention {missing}"
