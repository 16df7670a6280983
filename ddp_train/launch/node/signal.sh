# Signals one node's processes (run as `sh -c "$(cat signal.sh)" ddp-launch SIG PGID JOB_ID SCOPE`;
# launch/run/nodecontrol.py). Scope "all": its process group, then any process of this job (DDP_JOB_ID in
# its environment) in this host's network namespace that left the group; scope "leader": only the group
# leader (the agent running torchrun, which passes the signal on to its workers once). SIG "-" only
# lists them. Only this user's processes (another user's may carry the same variable), and the group
# only when PGID > 1 is a session leader of this user whose environment has the job's id, as `setsid`
# made the agent: a PGID line printed by anything else (a .bashrc) never reaches kill.
sig=$1; pgid=$2; id=$3; scope=$4; uid=$(id -u)
mine() { [ "$(sed -n 's/^Uid:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$1/status" 2>/dev/null)" = "$uid" ]; }
leader() {
  case "$1" in ''|*[!0-9]*) return 1 ;; esac
  [ "$1" -gt 1 ] && mine "$1" && grep -qxzsF -- "DDP_JOB_ID=$id" "/proc/$1/environ" || return 1
  set -- "$1" $(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null)  # pid, then state ppid pgrp session ...
  [ "$4" = "$1" ] && [ "$5" = "$1" ]
}
if [ "$sig" != - ] && leader "$pgid"; then
  if [ "$scope" = leader ]; then kill -s "$sig" "$pgid" 2>/dev/null
  else kill -s "$sig" -- "-$pgid" 2>/dev/null; fi
fi
me=$(readlink /proc/self/ns/net)
found=
for f in $(grep -lxzsF -- "DDP_JOB_ID=$id" /proc/[0-9]*/environ 2>/dev/null); do
  p=${f#/proc/}; p=${p%/environ}
  [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$me" ] || continue
  mine "$p" || continue
  if [ "$sig" != - ] && [ "$scope" != leader ]; then kill -s "$sig" "$p" 2>/dev/null; fi
  echo "JOBPROC $p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-160)"
  found=1
done
# Listing, and nothing of the job left: the private directories its killed agents could not remove
# (ddp_train/agent.py private_dir), if this user's: the ranks' stack dump files go (r<rank>.txt,
# ddp_train/stackdump.py) and torchrun's --log-dir (torchrun/), as the agent's own cleanup does, then the
# directory if that left it empty (one with an agent.log stays for whoever looks). mkdtemp's suffix is
# 8 characters (CPython Lib/tempfile.py _RandomNameSequence), so job "a" never matches job "a-b"'s
# directories.
if [ "$sig" = - ] && [ -z "$found" ]; then
  for d in "${TMPDIR:-/tmp}/ddp-agent-$id-"????????; do
    [ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] || continue
    for f in "$d"/r[0-9]*.txt; do
      case "${f##*/}" in r*[!0-9]*.txt) ;; *) [ -L "$f" ] || [ -f "$f" ] && rm -f -- "$f" ;; esac
    done
    [ -d "$d/torchrun" ] && [ ! -L "$d/torchrun" ] && rm -rf -- "$d/torchrun"
    rmdir -- "$d" 2>/dev/null
  done
fi
exit 0
