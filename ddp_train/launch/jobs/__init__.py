"""Detached jobs: their state in logs/<job>/ and the `jobs`, `status`, `logs`, `attach`, `stop` commands."""
