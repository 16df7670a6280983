"""firewalld executed for real on EL sim hosts (issue #25): a private system D-Bus and `firewalld --nofork`.

EL's default firewall is firewalld, which every real EL host runs; the sim hosts have no systemd, so
the testbed starts the two daemons itself, inside the host's own namespaces: its /run is a private
tmpfs (the bus socket /run/dbus/system_bus_socket is the host's own), its /etc an overlay (firewalld's
permanent configuration in /etc/firewalld is the host's own) and its network namespace holds the
`inet firewalld` table firewalld writes. The binaries are Debian's firewalld 1.3.3 and dbus-daemon
(EL9 ships firewalld 1.3.x with the nftables backend, its default since firewalld 0.6), reached through
the /usr overlay; `.ci/setup --with-testbed` installs them.

`start_commands()` is appended to the host's setup script (before sshd starts), so firewalld is
running when the first SSH session arrives, as after a real boot. Both daemons write their pid under
the host's state dir, and die with the host (`down` kills every process of its namespace).
"""

from __future__ import annotations

import shlex
from pathlib import Path

DBUS_DAEMON = "/usr/bin/dbus-daemon"
FIREWALLD = "/usr/sbin/firewalld"
FIREWALL_CMD = "/usr/bin/firewall-cmd"
START_TIMEOUT_S = 30


def missing() -> list[str]:
    """The binaries the sim needs that this machine lacks (Debian packages dbus-daemon and firewalld)."""
    return [p for p in (DBUS_DAEMON, FIREWALLD, FIREWALL_CMD) if not Path(p).exists()]


def start_commands(host_dir: Path) -> list[str]:
    """Shell commands (run as the host's setup, /run already mounted) that start D-Bus and firewalld."""
    log = shlex.quote(str(host_dir / "firewalld.log"))
    pid = shlex.quote(str(host_dir / "firewalld.pid"))
    dbus_pid = shlex.quote(str(host_dir / "dbus.pid"))
    tries = START_TIMEOUT_S * 10
    return [
        "mkdir -p /run/dbus",
        f"{DBUS_DAEMON} --system --fork --print-pid > {dbus_pid}",
        f"setsid {FIREWALLD} --nofork --nopid < /dev/null > {log} 2>&1 & echo $! > {pid}",
        # firewalld answers on the bus once it has loaded its zones and written its nftables table.
        f"i=0; until {FIREWALL_CMD} --state >/dev/null 2>&1; do i=$((i+1)); [ $i -lt {tries} ]"
        f' || {{ echo "firewalld did not start:"; tail -5 {log}; exit 1; }}; sleep 0.1; done',
    ]
