"""A firewalld the admin disabled or masked is left alone (issue #25): with systemd managing services,
`firewall_backend: auto` would take firewalld, and the firewall role stops in one line instead of
enabling and starting it. The EL sim hosts run no systemd: a stub systemctl in the host's own /usr
answers `is-enabled firewalld` with the unit state (rc 1, as systemctl does for both) and records every
call, so the test also sees that nothing started, enabled or unmasked firewalld. Own EL testbed: prefix
elfw, 10.213.58."""

from __future__ import annotations

import pytest

from tests.conftest import private_testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

STUB = """#!/bin/sh
echo "$*" >> /var/log/ddp-sim/systemctl.log
if [ "$1 $2" = "is-enabled firewalld" ]; then cat /var/lib/ddp-sim/firewalld-unit; exit 1; fi
echo "ddp-sim stub systemctl: $*" >&2; exit 1
"""


@pytest.fixture(scope="module")
def el_host():
    with private_testbed("elfw", "10.213.58", 1, os="rocky9", gpus=0) as tb:
        tb.ssh("node0", f"mkdir -p /var/log/ddp-sim && cat > /usr/local/sbin/systemctl <<'EOF'\n{STUB}EOF\n"
                        "chmod 755 /usr/local/sbin/systemctl")  # fmt: skip
        yield tb


@pytest.mark.parametrize("state", ["masked", "disabled"])
def test_auto_does_not_start_a_firewalld_the_admin_turned_off(el_host, playbook, state):
    tb = el_host
    tb.ssh("node0", f"echo {state} > /var/lib/ddp-sim/firewalld-unit; : > /var/log/ddp-sim/systemctl.log")
    assert tb.ssh("node0", "firewall-cmd --state", check=False).returncode != 0  # not running
    res = playbook("-i", str(tb.inventory), "-e", "firewall_service_manage=true", "playbooks/base.yml")
    assert res.returncode == 2, res.out[-3000:]
    assert (
        f"node0: firewalld is installed but {state}; the role does not turn on a firewall the admin turned "
        "off. Set firewall_backend: nftables (a table of its own), or firewall_firewalld_enable: true to "
        "enable and start firewalld." in res.out
    ), res.out[-3000:]
    calls = tb.ssh("node0", "cat /var/log/ddp-sim/systemctl.log").stdout.splitlines()
    assert calls == ["is-enabled firewalld"], calls
    assert tb.ssh("node0", "firewall-cmd --state", check=False).returncode != 0
