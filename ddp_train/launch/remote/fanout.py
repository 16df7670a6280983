"""Bounded fan-out of the launcher's short steps over the nodes: Ansible's `forks`.

Connecting, probing, copying and teardown run `fn` over the nodes in at most `forks` threads at once,
as ansible-playbook runs a task on at most `forks` hosts at once; the long-lived job channels are not
bounded by it (one thread per node, see job.py). The default is what Ansible itself would use: the
inventory's `ddp_forks`, else ansible.cfg [defaults] forks / ANSIBLE_FORKS read with Ansible's config
API, else Ansible's own default (5).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
ANSIBLE_DEFAULT_FORKS = 5  # ansible-core lib/ansible/config/base.yml DEFAULT_FORKS
_forks: int | None = None


def set_forks(forks: int | None) -> None:
    """The bound for every later `parallel` call (None: unbounded, one thread per item)."""
    global _forks
    _forks = forks


def ansible_forks() -> int:
    """ansible.cfg [defaults] forks (or ANSIBLE_FORKS), as Ansible finds its config; else 5."""
    try:
        from ansible import constants  # already loaded by the inventory: the same config it found

        value = int(constants.DEFAULT_FORKS)
    except Exception:  # an ansible.cfg it cannot read: loading the inventory says so itself
        return ANSIBLE_DEFAULT_FORKS
    return value if value > 0 else ANSIBLE_DEFAULT_FORKS


def rounds(n: int, forks: int | None = None) -> int:
    """How many batches `parallel` needs for n items: what a step that waits on all of them must allow."""
    bound = forks or _forks or n or 1
    return -(-n // bound)


def parallel(fn: Callable[[Any], T], items: Sequence[Any], forks: int | None = None) -> list[T]:
    """fn over items in at most `forks` threads (default: set_forks's), results in order."""
    if not items:
        return []
    bound = forks or _forks or len(items)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(bound, len(items))) as pool:
        return list(pool.map(fn, items))
