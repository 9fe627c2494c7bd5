#!/usr/bin/env bash
# Times ./scripts/demo as a newcomer's first command: a fresh clone of this
# repository in a pristine Debian bookworm root (debootstrap minbase plus git
# and ca-certificates; no cmake, g++ or make), run under a clean environment,
# so the demo installs its own packages with apt-get. A development tool
# (root, debootstrap and Debian's mirror needed), not run by ./scripts/test.
#   sudo bench/demo_fresh_machine.sh [REPO=this checkout's HEAD] [LOG=build/fresh-machine/demo.log]
# The pristine root is made once (build/fresh-machine/pristine.tar, about
# 250 MB) and unpacked afresh for every run. Prints the wall time and its
# split: apt, configure + build, the demo itself.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=${1:-$ROOT}
WORK=$ROOT/build/fresh-machine
LOG=${2:-$WORK/demo.log}
PRISTINE=$WORK/pristine.tar
RUN=$WORK/root
MOUNTS=(proc sys dev dev/pts dev/shm)  # mounted in this order, unmounted in reverse

[ "$(id -u)" -eq 0 ] || { echo "demo_fresh_machine: run as root (chroot, mounts)" >&2; exit 1; }
mkdir -p "$WORK"

mounted_under_run() { mount | grep -q " $RUN/"; }

cleanup() {
  local rc=$? i
  # A demo child still rooted in the chroot would hold its mounts.
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$RUN" ] && kill -9 "${p#/proc/}" 2>/dev/null
  done
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    mountpoint -q "$RUN/${MOUNTS[i]}" && { umount "$RUN/${MOUNTS[i]}" || umount -l "$RUN/${MOUNTS[i]}"; }
  done
  mounted_under_run && echo "demo_fresh_machine: still mounted under $RUN" >&2
  return $rc
}

if [ ! -f "$PRISTINE" ]; then
  command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null || exit 1
  rm -rf --one-file-system "$WORK/pristine"
  debootstrap --variant=minbase --include=git,ca-certificates bookworm "$WORK/pristine" \
    http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 ||
    { echo "demo_fresh_machine: debootstrap failed ($WORK/debootstrap.log)" >&2; exit 1; }
  # The host's sources (updates and security too) and resolver; no indexes
  # or downloaded packages kept, as on a fresh image.
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    rm -f "$WORK/pristine/etc/apt/sources.list"
    cp /etc/apt/sources.list.d/debian.sources "$WORK/pristine/etc/apt/sources.list.d/"
  fi
  cp /etc/resolv.conf "$WORK/pristine/etc/"
  rm -rf "$WORK/pristine/var/lib/apt/lists/"* "$WORK/pristine/var/cache/apt/archives/"*.deb
  tar --numeric-owner --xattrs -cpf "$PRISTINE" -C "$WORK/pristine" . || exit 1
  rm -rf --one-file-system "$WORK/pristine"
fi

mounted_under_run && { cleanup; mounted_under_run && exit 1; }
rm -rf --one-file-system "$RUN"
mkdir -p "$RUN"
trap cleanup EXIT
trap 'exit 130' INT TERM
tar --numeric-owner --xattrs -xpf "$PRISTINE" -C "$RUN" || exit 1
for m in "${MOUNTS[@]}"; do
  mkdir -p "$RUN/$m"
  mount --bind "/$m" "$RUN/$m" || exit 1
done
git clone -q --no-local "$SRC" "$RUN/root/mstar-kv" || exit 1
for p in cmake g++ make; do
  if chroot "$RUN" dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    echo "demo_fresh_machine: $p is installed in the pristine root" >&2
    exit 1
  fi
done

mkdir -p "$(dirname "$LOG")"
echo "demo_fresh_machine: $(git -C "$RUN/root/mstar-kv" log -1 --format='%h %s'); $(nproc) cores," \
  "load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$LOG"
T0=$EPOCHREALTIME
chroot "$RUN" /usr/bin/env -i HOME=/root TERM=dumb \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /bin/bash -c 'cd /root/mstar-kv && ./scripts/demo' 2>&1 | tee -a "$LOG"
DEMO_RC=${PIPESTATUS[0]}
T1=$EPOCHREALTIME

secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
{
  echo "demo_fresh_machine: ./scripts/demo exit status $DEMO_RC, wall time $(secs "$T0" "$T1") s"
  # apt's own record of the install (1 s resolution); apt-get update precedes it.
  HIST=$RUN/var/log/apt/history.log
  S=$(sed -n 's/^Start-Date: //p' "$HIST" 2>/dev/null | tail -1)
  E=$(sed -n 's/^End-Date: //p' "$HIST" 2>/dev/null | tail -1)
  if [ -n "$S" ] && [ -n "$E" ]; then
    S=$(date -d "${S/  / }" +%s)
    E=$(date -d "${E/  / }" +%s)
    echo "  apt-get update:     $(secs "$T0" "$S") s"
    echo "  apt-get install:    $(secs "$S" "$E") s"
  fi
  BIN=$RUN/root/mstar-kv/build/demo/tools/mstar-kv
  if [ -f "$BIN" ]; then
    B=$(stat -c %.9Y "$BIN")
    echo "  configure + build:  $(secs "${E:-$T0}" "$B") s"
    echo "  the demo:           $(secs "$B" "$T1") s"
  fi
} | tee -a "$LOG"
exit "$DEMO_RC"
