"""The testbed's neighbour-table sizing: raised for the live testbeds, restored at down, and never
lowering what someone else set (the thresholds are one per kernel; issue #19)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.testbed import neigh

T3 = "net.ipv4.neigh.default.gc_thresh3"


@pytest.fixture
def sysctls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake /proc/sys with the kernel defaults 128/512/1024, and a private state file."""
    root = tmp_path / "proc"
    for name in neigh.SYSCTLS:
        f = root / name.replace(".", "/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text({"1": "128\n", "2": "512\n", "3": "1024\n"}[name[-1]])
    monkeypatch.setattr(neigh, "_path", lambda name: root / name.replace(".", "/"))
    monkeypatch.setattr(neigh, "STATE", tmp_path / "run" / "neigh.json")
    return root


def test_64_hosts_raise_every_threshold_above_the_full_mesh(sysctls: Path) -> None:
    notes = neigh.acquire("scl", 64)
    assert f"{T3} 1024 -> {4 * 64 * 65}" in notes
    assert all(neigh.read(n) >= 64 * 64 for n in neigh.SYSCTLS)
    assert f"{T3} {4 * 64 * 65} -> 1024" in neigh.release("scl")
    assert [neigh.read(n) for n in neigh.SYSCTLS] == [128, 512, 1024] * 2


def test_release_keeps_what_another_live_testbed_needs(sysctls: Path) -> None:
    neigh.acquire("a", 64)
    neigh.acquire("b", 40)  # needs less: nothing changes
    assert neigh.read(T3) == neigh.wanted(64)[T3]
    notes = neigh.release("a")
    assert neigh.read(T3) == neigh.wanted(40)[T3]
    assert f"{T3} {neigh.wanted(64)[T3]} -> {neigh.wanted(40)[T3]}" in notes
    neigh.release("b")
    assert neigh.read(T3) == 1024
    assert not neigh.STATE.exists()


def test_a_value_changed_by_someone_else_meanwhile_is_left_alone(sysctls: Path) -> None:
    neigh.acquire("a", 64)
    (sysctls / T3.replace(".", "/")).write_text("99999\n")  # an admin (or H-provision's role) raised it
    neigh.release("a")
    assert neigh.read(T3) == 99999
    assert neigh.read("net.ipv4.neigh.default.gc_thresh1") == 128  # the untouched ones are restored


def test_a_higher_value_already_set_is_never_lowered(sysctls: Path) -> None:
    (sysctls / T3.replace(".", "/")).write_text("200000\n")
    assert not any(n.startswith(T3) for n in neigh.acquire("a", 8))
    neigh.release("a")
    assert neigh.read(T3) == 200000
