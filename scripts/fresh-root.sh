#!/bin/sh
# `make run` on a pristine Debian 12, as a new user's machine would be: debootstrap minbase plus
# python3, git and make, this repository's HEAD copied in (git archive, so only what is
# committed), then `make run` timed inside it. It runs under bubblewrap as root, not chroot: a
# chroot cannot create the user namespaces the sandboxes inside need (the kernel refuses
# unshare(CLONE_NEWUSER) to a chrooted process), while bwrap pivots into the tree.
#
# The tree sees the host's /dev (loop devices for the sandboxes' disks), /sys (the cgroups they
# are limited by) and network (apt and PyPI: the host's /etc/resolv.conf is copied in), and
# nothing else: no pip cache, no pip.conf, no environment but PATH, HOME and LANG, and
# PIP_CERT where FRESH_ROOT_CA_BUNDLE is set (below).
#
# Settings (environment): FRESH_ROOT (the tree, default /var/tmp/sandlot-fresh-root; copied
# afresh each time from the debootstrapped $FRESH_ROOT.base, which is kept for the next run
# unless FRESH_ROOT_REBUILD=1), FRESH_ROOT_SUITE (bookworm), FRESH_ROOT_MIRROR (deb.debian.org), FRESH_ROOT_CACHE
# (where debootstrap keeps its .debs between runs: /var/cache/apt/archives, apt's own cache),
# FRESH_ROOT_TARGETS (the make targets to time, "run"; "run venv check trees pytest" is
# `make test` without its docker subset, which would start a second dockerd inside the tree,
# beside the host's, in its network namespace and cgroup tree: not run), FRESH_ROOT_CA_BUNDLE (a CA
# bundle pip inside should trust; default: the host's PIP_CERT, if any: where egress goes
# through a TLS-intercepting proxy, its CA is in the host's bundle and in no fresh machine's;
# on an open network, leave both unset).
# Output: the log of each target and a summary, in $FRESH_ROOT.log.
set -eu

ROOT=${FRESH_ROOT:-/var/tmp/sandlot-fresh-root}
SUITE=${FRESH_ROOT_SUITE:-bookworm}
MIRROR=${FRESH_ROOT_MIRROR:-http://deb.debian.org/debian}
CACHE=${FRESH_ROOT_CACHE:-/var/cache/apt/archives}
TARGETS=${FRESH_ROOT_TARGETS:-run}
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=$ROOT.log
CA_BUNDLE=${FRESH_ROOT_CA_BUNDLE:-${PIP_CERT:-}}
MARK=.sandlot-fresh-root

[ "$(id -u)" = 0 ] || { echo "fresh-root.sh: run as root (debootstrap and the sandboxes need it)" >&2; exit 1; }
for tool in debootstrap bwrap git; do
  command -v "$tool" >/dev/null || { echo "fresh-root.sh: $tool is missing (apt-get install $tool)" >&2; exit 1; }
done
# Never delete a directory this script did not make.
if [ -e "$ROOT" ] && [ ! -e "$ROOT/$MARK" ]; then
  echo "fresh-root.sh: $ROOT exists and was not made by this script; remove it or set FRESH_ROOT" >&2
  exit 1
fi

now() { date +%s; }
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

BASE=$ROOT.base
if [ -e "$BASE" ] && [ ! -e "$BASE/$MARK" ]; then
  echo "fresh-root.sh: $BASE exists and was not made by this script" >&2
  exit 1
fi
if [ "${FRESH_ROOT_REBUILD:-0}" = 1 ] || [ ! -e "$BASE/$MARK.done" ]; then
  rm -rf "$BASE"
  mkdir -p "$BASE" "$CACHE"
  touch "$BASE/$MARK"
  say "debootstrap $SUITE minbase + python3, git, make into $BASE (debs cached in $CACHE)"
  start=$(now)
  debootstrap --variant=minbase --include=python3,git,make --cache-dir="$CACHE" \
    "$SUITE" "$BASE" "$MIRROR" >>"$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
  touch "$BASE/$MARK.done"
  say "debootstrap: $(($(now) - start)) s"
else
  say "reusing the debootstrapped $BASE (FRESH_ROOT_REBUILD=1 makes it anew)"
fi
# Each run starts from an untouched copy: nothing a previous `make` installed is left.
rm -rf "$ROOT"
cp -a "$BASE" "$ROOT"
rm -f "$ROOT/$MARK.done"

cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
mkdir -p "$ROOT/root/sandlot"
pip_cert=""
if [ -n "$CA_BUNDLE" ]; then
  cp "$CA_BUNDLE" "$ROOT/etc/fresh-root-ca.crt"
  pip_cert=PIP_CERT=/etc/fresh-root-ca.crt
  say "pip inside trusts $CA_BUNDLE (as $pip_cert)"
fi
git -C "$REPO" archive HEAD | tar -x -C "$ROOT/root/sandlot"
say "copied $(git -C "$REPO" rev-parse --short HEAD) into /root/sandlot"

summary=""
failed=0
for target in $TARGETS; do
  say "--- make $target (inside the fresh root)"
  start=$(now)
  # --cap-add ALL: root in the tree keeps what root on a real machine has (apt, mounts,
  # cgroups); with no user namespace of its own, that is the host's root, as on a real host.
  # The status goes through a file: in a pipeline, sh keeps only tee's. The tree's own /tmp
  # (mode 1777) stays: apt hands files to its unprivileged _apt user there. The host's /proc,
  # not a new one (--proc): bwrap masks parts of a proc it mounts, and the kernel refuses a
  # sandbox's own proc mount where the only proc in sight is partly covered. The tree is
  # bound with its device nodes working (--dev-bind; --bind is nodev), as a real root file
  # system is: `make test` debootstraps the environments' trees, and debootstrap refuses a
  # target where it cannot use a device node it made ("test-dev-null: Permission denied").
  { status=0
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
      LANG=C.UTF-8 $pip_cert \
      bwrap --dev-bind "$ROOT" / --dev-bind /dev /dev --bind /proc /proc --bind /sys /sys \
      --unshare-ipc --unshare-uts --die-with-parent --cap-add ALL \
      --chdir /root/sandlot make "$target" 2>&1 || status=$?
    echo "$status" >"$LOG.status"
  } | tee -a "$LOG"
  status=$(cat "$LOG.status")
  rm -f "$LOG.status"
  summary="$summary
make $target: exit $status, wall $(($(now) - start)) s"
  if [ "$status" != 0 ]; then failed=1; break; fi
done

say "--- summary ($SUITE minbase + python3, git, make; $(nproc) cores)$summary"
say "installed by make:"
grep -E '^(installing |Successfully installed)' "$LOG" | sed 's/^/  /'
exit "$failed"
