"""Process exit codes of `ddp-train` (the launcher and torchrun see these)."""

OK = 0
FAILURE = 1  # an unexpected error (traceback printed)
# config, --set, plug-in, data file or checkpoint refused with one line; also a bad environment: a disk
# that refuses a write (full, quota, read-only, permission, I/O error: storage.StorageError)
BAD_INPUT = 2
RANKS_DIFFER = 3  # training finished but the ranks' parameters are not identical
SIGTERM = 143  # stopped by SIGTERM after saving a checkpoint (128 + 15, as a shell reports it)
SIGINT = 130  # the same for SIGINT (Ctrl-C)
# ddp-launch's own: the stall watchdog found no progress for --stall-timeout, dumped every rank's
# stack to logs/<job>/stacks/ and stopped the job (launch/watchdog.py).
STALLED = 4
