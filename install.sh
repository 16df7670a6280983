#!/usr/bin/env bash
# Install the controller side of ddp-train from this clone: a venv with the project (editable: a
# `git pull` here updates it) and everything constraints.txt pins, ansible among them (the `ansible`
# package carries the collections the playbooks use: community.general, containers.podman, ...), then
# links ddp-launch, ddp-train and the ansible commands (ansible-vault too, for a become password kept in a
# vault) into a bin directory on PATH.
#
#   ./install.sh [--prefix DIR] [--bin DIR] [--force] [--with EXTRAS]
#     --prefix DIR   where the venv goes [${XDG_DATA_HOME:-~/.local/share}/ddp-train]
#     --bin DIR      where the commands are linked [~/.local/bin]
#     --force        replace commands of the same names already in --bin (kept otherwise)
#     --with EXTRAS  optional parts, comma-separated: bpe (ddp-train prepare --tokenizer bpe), plot
#                    (metrics.png), tensorboard; "" for none [bpe,plot]
#   DDP_PYTHON=/path/to/python3.11 ./install.sh    # pick the interpreter (>= 3.11, as ansible-core needs)
#
# Linux or macOS (Homebrew's python@3.11 or newer). Re-running it updates the venv in place.
set -euo pipefail
cd "$(dirname "$0")"

prefix=${XDG_DATA_HOME:-$HOME/.local/share}/ddp-train
bin=$HOME/.local/bin
force=0
extras=bpe,plot
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix|--bin|--with)
      # a missing value is a usage error (exit 2) in one line, not the shell's own message
      [ $# -ge 2 ] || { echo "install.sh: $1 needs a value (--with: a comma list of bpe, plot, tensorboard, or \"\")" >&2; exit 2; }
      case "$1" in --prefix) prefix=$2 ;; --bin) bin=$2 ;; --with) extras=$2 ;; esac
      shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (known: --prefix DIR, --bin DIR, --force, --with EXTRAS)" >&2; exit 2 ;;
  esac
done
names=""  # the list again without empty entries ("bpe,", "bpe, plot"), which pip's extras syntax refuses
for e in ${extras//,/ }; do
  case "$e" in
    bpe|plot|tensorboard) names="${names:+$names,}$e" ;;
    *) echo "install.sh: --with: unknown extra '$e' (known: bpe, plot, tensorboard)" >&2; exit 2 ;;
  esac
done
extras=$names
COMMANDS="ddp-launch ddp-train ansible ansible-playbook ansible-galaxy ansible-inventory ansible-config ansible-vault"

pick_python() {
  for p in ${DDP_PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  return 1
}
if ! PY=$(pick_python); then
  echo "install.sh: need Python >= 3.11 with the venv module (Linux: python3.11 and python3.11-venv from" \
       "the distribution; macOS: brew install python@3.11), or set DDP_PYTHON" >&2
  exit 1
fi

venv=$prefix/venv
echo "install.sh: venv $venv ($("$PY" -V 2>&1))"
"$PY" -m venv "$venv"
# pip warns once per package about a machine's file:// index mirrors; keep the output readable.
quiet_pip() { "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }
quiet_pip install -q --upgrade pip
quiet_pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
for c in $COMMANDS; do
  [ -x "$venv/bin/$c" ] || { echo "install.sh: $venv/bin/$c missing after pip install" >&2; exit 1; }
done

mkdir -p "$bin"
linked="" kept=""
for c in $COMMANDS; do
  # Another install's command there (a distribution's or pipx's ansible, say) stays as it was.
  if { [ -e "$bin/$c" ] || [ -L "$bin/$c" ]; } && [ "$(readlink "$bin/$c")" != "$venv/bin/$c" ] && [ "$force" = 0 ]; then
    kept="$kept $c"
    continue
  fi
  ln -sfn "$venv/bin/$c" "$bin/$c"  # console scripts run the venv's python by their #! line
  linked="$linked $c"
done
"$venv/bin/ddp-launch" --help >/dev/null
echo "install.sh: $("$venv/bin/ansible-playbook" --version | head -1); extras: ${extras:-none}; linked into $bin:${linked:- nothing}"
if [ -n "$kept" ]; then
  echo "install.sh: kept what $bin already had for:$kept (not ours; ours are in $venv/bin;" \
       "./install.sh --force replaces them)"
fi
case ":$PATH:" in
  *":$bin:"*) ;;
  *) echo "install.sh: $bin is not on PATH; add it: export PATH=\"$bin:\$PATH\" (in ~/.bashrc or ~/.zshrc)" ;;
esac
