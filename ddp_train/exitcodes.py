"""Process exit codes of `ddp-train` and of `ddp-launch` (torchrun and the shell see these)."""

OK = 0
FAILURE = 1  # an unexpected error (traceback printed)
# config, --set, plug-in, data file or checkpoint refused with one line; also a bad environment: a disk
# that refuses a write (full, quota, read-only, permission, I/O error: storage.StorageError)
BAD_INPUT = 2
RANKS_DIFFER = 3  # training finished but the ranks' parameters are not identical
SIGTERM = 143  # stopped by SIGTERM after saving a checkpoint (128 + 15, as a shell reports it)
SIGINT = 130  # the same for SIGINT (Ctrl-C)

# ddp-launch's own (launch/cli.py); BAD_INPUT and 128+N mean there what they mean above.
NODE_FAILED = 1  # a node failed, could not start, or was lost
PREFLIGHT = 3  # preflight failed, or another job runs on the same nodes and port
# the stall watchdog found no progress for --stall-timeout, dumped every rank's stack to
# logs/<job>/stacks/ and stopped the job (launch/run/watchdog.py)
STALLED = 4
TIMEOUT = 124  # --timeout reached (as timeout(1) exits)

# `ddp-launch --help` shows this table (the only place it is written).
LAUNCH_TABLE = """exit codes: 0 ok; 1 a node failed, could not start or was lost; 2 bad input (with --strict:
  a script check finding); 3 preflight failed (with --strict: a backend the nodes' GPUs contradict),
  or another job runs on the same nodes and port; 4 stalled (the stall watchdog stopped the job);
  124 --timeout; 130 Ctrl-C, 143 SIGTERM (128+N for signal N). A stop lets every rank finish its step
  and save a checkpoint (run the same command again to resume); a second Ctrl-C kills at once."""
