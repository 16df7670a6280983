# Runs on a node (`sh -c "$(cat stack.sh)" ddp-stacks JOB_ID NODE_RANK`; launch/run/watchdog.py): list the
# job's workers of this node (RANK in their environment, GROUP_RANK = the node rank: local nodes share
# one /proc) in this network namespace, owned by this user, SIGUSR1 each one whose SigCgt mask says it
# handles it (bit 9: SIGUSR1 = 10; an unhandled SIGUSR1 would kill the process), py-spy where
# installed, then print every dump. Each worker's dump is in its DDP_STACK_DIR: the node agent's
# private 0700 directory (ddp_train/agent.py), used only when it is a directory of this user's (never a
# path another user could have prepared, issue #24).
id=$1; node=$2; found=""; uid=$(id -u)
me=$(readlink /proc/self/ns/net)
for f in $(grep -lxzsF -- "DDP_JOB_ID=$id" /proc/[0-9]*/environ 2>/dev/null); do
  p=${f#/proc/}; p=${p%/environ}
  [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$me" ] || continue
  [ "$(sed -n 's/^Uid:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$p/status" 2>/dev/null)" = "$uid" ] || continue
  grep -qxzF -- "GROUP_RANK=$node" "$f" 2>/dev/null || continue
  rank=$(tr '\0' '\n' < "$f" 2>/dev/null | sed -n 's/^RANK=//p')
  dir=$(tr '\0' '\n' < "$f" 2>/dev/null | sed -n 's/^DDP_STACK_DIR=//p')
  case "$rank" in ''|*[!0-9]*) continue ;; esac
  echo "WORKER $p $rank"
  [ -n "$dir" ] && [ -d "$dir" ] && [ ! -L "$dir" ] && [ -O "$dir" ] || dir=""
  found="$found $rank:$dir"
  cgt=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$p/status" 2>/dev/null)
  [ -n "$cgt" ] && [ $(( (0x$cgt >> 9) & 1 )) = 1 ] && kill -USR1 "$p" 2>/dev/null
  if [ -n "$dir" ] && command -v py-spy >/dev/null 2>&1; then
    (set -C; timeout 20 py-spy dump --pid "$p" > "$dir/py-spy-r$rank.txt" 2>&1) &
  fi
done
sleep 2
wait
# The launcher keeps the stacks (logs/<job>/stacks/); each one printed is removed from the node.
for rd in $found; do
  rank=${rd%%:*}; dir=${rd#*:}
  [ -n "$dir" ] || continue
  for name in "r$rank.txt" "py-spy-r$rank.txt"; do
    [ -f "$dir/$name" ] && [ ! -L "$dir/$name" ] || continue
    echo "==> $name"
    cat -- "$dir/$name"
    rm -f -- "$dir/$name"
  done
done
exit 0
