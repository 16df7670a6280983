"""Reaching the nodes: SSH or local sessions, the session pool, the bounded fan-out, the open-file limit,
and `--sync DIR`."""
