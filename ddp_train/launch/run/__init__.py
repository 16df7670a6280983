"""Running a planned job: every node's run, the fail-fast and stop policy, logs, progress, the stall
watchdog, and the report."""
