#!/usr/bin/env bash
# rxe_vm.sh [--prepare] SCRIPT [ARGS...]
#
# Runs SCRIPT (bash) inside a small VM that has real verbs devices: soft-RoCE
# (rdma_rxe) over veth pairs. The VM boots Debian's stock kernel in qemu,
# with this host's / as its root (9p, read-only, under a RAM overlay), so
# SCRIPT can run binaries built here at the same paths. Output is streamed;
# the exit code is SCRIPT's.
#
# This machine's kernel has no RDMA, and /dev/kvm (when present) may be
# kvm_pvm, which cannot boot a stock kernel, so the VM runs under TCG:
# about 10 s from qemu start to rxe ready on a 2-core host.
#
# Inside SCRIPT (all in the VM's initial network namespace: the 6.1 kernel's
# rxe only sends and receives there):
#   RXE_NDEV      2, 4 or 8
#   rank A side:  RXE_DEV_A=rxe0 (veth0, RXE_IP_A=198.51.100.1, RoCE v2 GID index RXE_GID_A)
#   rank B side:  RXE_DEV_B=rxe1 (veth1, RXE_IP_B=198.51.100.2, RXE_GID_B)
#   with 4:       RXE_DEV_C=rxe2 (veth2, .3, RXE_GID_C) pairs with RXE_DEV_D=rxe3 (veth3, .4, RXE_GID_D)
#   every device: RXE_DEV_i=rxe<i> on veth<i>, RXE_IP_i=198.51.100.<i+1>, RXE_GID_i; rxe(2k) and
#                 rxe(2k+1) are the two ends of wire k (with 8: four wires, a ring of four hosts)
# veth0<->veth1 and veth2<->veth3 are wires: policy routing sends traffic
# between the two addresses of a pair across its wire (see guest_stage2.sh).
#
# --prepare: install what is missing and build the initramfs, then exit 0.
# Exit 77 (with "rxe-vm: cannot start: REASON" on stderr) where the VM cannot
# start here: not root, packages missing and not installable, no kernel with
# rdma_rxe, no qemu. 125: the VM ended without an exit code.
#
# Environment (all optional):
#   RXE_VM_NDEV     2 (default), 4 or 8 rxe devices
#   RXE_VM_MEM      guest RAM in MiB (default 2048)
#   RXE_VM_CPUS     guest vCPUs (default 4: steadier than 2 even on a 2-core host)
#   RXE_VM_TIMEOUT  wall-clock limit for the whole VM in seconds (default 900)
#   RXE_VM_ACCEL    auto (default) | tcg | kvm
#   RXE_VM_RW       a host directory shared READ-WRITE at the same path in the VM
#                   (everything else the VM writes goes to RAM and is discarded)
#   RXE_VM_KERNEL   kernel version to boot (default: newest /boot/vmlinuz-* with rdma_rxe.ko)
#   RXE_VM_INSTALL  1 (default): apt-get install what is missing; 0: never
#   RXE_VM_KEEP=1   keep the per-run directory (console log etc.) under /tmp
#   RXE_VM_QUIET=1  do not print the [rxe-vm] progress lines
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { [[ ${RXE_VM_QUIET:-0} == 1 ]] || echo "[rxe-vm] $*" >&2; }
cannot() { echo "rxe-vm: cannot start: $*" >&2; exit 77; }
T_START=$(date +%s.%N)
elapsed() { awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

PREPARE=0
if [[ ${1:-} == --prepare ]]; then PREPARE=1; shift; fi
if [[ $PREPARE == 0 && ( $# -lt 1 || $1 == -h || $1 == --help ) ]]; then
  sed -n '2,40p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2
fi
if [[ $PREPARE == 0 ]]; then
  SCRIPT=$(readlink -f "$1"); shift
  [[ -f $SCRIPT ]] || { echo "rxe_vm.sh: no such script: $SCRIPT" >&2; exit 2; }
fi
[[ $(id -u) == 0 ]] || cannot "must run as root (it installs packages and reads /boot/vmlinuz-*)"
NDEV=${RXE_VM_NDEV:-2}
[[ $NDEV == 2 || $NDEV == 4 || $NDEV == 8 ]] || { echo "RXE_VM_NDEV must be 2, 4 or 8" >&2; exit 2; }

# ---------- 1. packages (idempotent) ----------
PKGS=(qemu-system-x86 linux-image-amd64 rdma-core ibverbs-utils ibverbs-providers
      libibverbs-dev iproute2 busybox-static kmod cpio gzip)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  [[ ${RXE_VM_INSTALL:-1} == 1 ]] || cannot "packages missing: ${missing[*]}; install them as root with tests/verbs/rxe_vm.sh --prepare (or apt-get install ${missing[*]}), as .ci/run does"
  command -v apt-get >/dev/null || cannot "packages missing and no apt-get: ${missing[*]}"
  say "installing: ${missing[*]}"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}"; } >&2 || cannot "apt-get install ${missing[*]} failed"
fi
command -v qemu-system-x86_64 >/dev/null || cannot "no qemu-system-x86_64"

# ---------- 2. kernel ----------
KVER=${RXE_VM_KERNEL:-}
if [[ -z $KVER ]]; then
  for v in $(ls /boot/vmlinuz-* 2>/dev/null | sed 's|/boot/vmlinuz-||' | sort -V -r); do
    if [[ -n $(find "/lib/modules/$v/kernel/drivers/infiniband/sw/rxe" -name 'rdma_rxe.ko*' 2>/dev/null) ]]; then
      KVER=$v; break
    fi
  done
fi
[[ -n $KVER && -f /boot/vmlinuz-$KVER ]] || cannot "no /boot/vmlinuz-* with an rdma_rxe module (apt-get install linux-image-amd64)"
[[ -r /boot/vmlinuz-$KVER ]] || cannot "/boot/vmlinuz-$KVER is not readable"

# ---------- 3. initramfs (cached; rebuilt when the init script or the kernel changes) ----------
CACHE=/tmp/jax-arx-rxe-vm-cache
INITRD=$CACHE/initramfs-$KVER.gz
mkdir -p "$CACHE"
if [[ ! -s $INITRD || $HERE/initramfs_init.sh -nt $INITRD || /lib/modules/$KVER/modules.dep -nt $INITRD ]]; then
  say "building initramfs for $KVER"
  ird=$(mktemp -d "$CACHE/ird.XXXXXX")
  mkdir -p "$ird"/{bin,mod,proc,sys,dev,lower,rw,newroot}
  cp /bin/busybox "$ird/bin/busybox"
  : > "$ird/mod/order"
  for m in virtio_pci 9pnet_virtio 9p overlay; do
    modprobe -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
  done | awk '!seen[$0]++' | while read -r f; do
    case $f in
      *.ko.xz)  xz -dc "$f"   > "$ird/mod/$(basename "$f" .xz)";  echo "$(basename "$f" .xz)" >> "$ird/mod/order" ;;
      *.ko.zst) zstd -qdc "$f" > "$ird/mod/$(basename "$f" .zst)"; echo "$(basename "$f" .zst)" >> "$ird/mod/order" ;;
      *)        cp "$f" "$ird/mod/"; basename "$f" >> "$ird/mod/order" ;;
    esac
  done
  install -m 755 "$HERE/initramfs_init.sh" "$ird/init"
  (cd "$ird" && find . | cpio -o -H newc --quiet | gzip -1) > "$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"; rm -rf "$ird"
fi
if [[ $PREPARE == 1 ]]; then say "ready: kernel $KVER, initramfs $INITRD"; exit 0; fi

# ---------- 4. per-run share ----------
RUN=$(mktemp -d /tmp/jax-arx-rxe-vm-run.XXXXXX)
QPID=""
cleanup() {
  [[ -n $QPID ]] && kill "$QPID" 2>/dev/null || true   # only our own qemu, by PID
  if [[ ${RXE_VM_KEEP:-0} == 1 ]]; then say "run dir kept: $RUN"; else rm -rf "$RUN"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cp "$HERE/guest_stage2.sh" "$RUN/stage2.sh"
cp "$SCRIPT" "$RUN/user-script"
: > "$RUN/args"; if (($#)); then printf '%s\n' "$@" > "$RUN/args"; fi   # one argument per line
pwd > "$RUN/cwd"
: > "$RUN/output"

# ---------- 5. accelerator ----------
ACCEL=${RXE_VM_ACCEL:-auto}
if [[ $ACCEL == auto ]]; then
  # /dev/kvm may be PVM (kvm_pvm), which only runs PVM-enabled guest kernels;
  # a stock kernel hangs in its decompressor there. KVM only with kvm_intel/kvm_amd.
  if [[ -r /dev/kvm && -w /dev/kvm ]] && [[ -d /sys/module/kvm_intel || -d /sys/module/kvm_amd ]] && [[ ! -d /sys/module/kvm_pvm ]]; then
    ACCEL=kvm; else ACCEL=tcg; fi
fi
if [[ $ACCEL == kvm ]]; then ACCEL_ARGS=(-accel kvm -cpu host); else ACCEL_ARGS=(-accel tcg,thread=multi -cpu max); fi

RW_ARGS=(); RW_CMD=""
if [[ -n ${RXE_VM_RW:-} ]]; then
  RXE_VM_RW=$(readlink -f "$RXE_VM_RW"); [[ -d $RXE_VM_RW ]] || { echo "RXE_VM_RW is not a directory" >&2; exit 2; }
  RW_ARGS=(-virtfs "local,path=$RXE_VM_RW,mount_tag=hostrw,security_model=none,multidevs=remap")
  RW_CMD=" rxe_rw=$RXE_VM_RW"
fi

T_QEMU=$(date +%s.%N)
say "booting $KVER (accel=$ACCEL, ${RXE_VM_CPUS:-4} vCPU, ${RXE_VM_MEM:-2048} MiB, $NDEV rxe devices)"
timeout --foreground -k 5 "${RXE_VM_TIMEOUT:-900}" \
  qemu-system-x86_64 "${ACCEL_ARGS[@]}" -m "${RXE_VM_MEM:-2048}" -smp "${RXE_VM_CPUS:-4}" \
    -display none -no-reboot -nic none -serial "file:$RUN/console.log" -monitor none \
    -kernel "/boot/vmlinuz-$KVER" -initrd "$INITRD" \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$RUN,mount_tag=rxeout,security_model=none,multidevs=remap" \
    "${RW_ARGS[@]}" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init rxe_ndev=$NDEV$RW_CMD" \
    </dev/null >"$RUN/qemu.log" 2>&1 &
QPID=$!
# stream the script's output while the VM runs
tail -n +1 -s 0.3 -f --pid=$QPID "$RUN/output" &
TPID=$!
qrc=0; wait $QPID || qrc=$?
QPID=""
wait $TPID 2>/dev/null || true
[[ -s $RUN/output && -n $(tail -c1 "$RUN/output") ]] && echo   # output lacked a final newline

if [[ -f $RUN/ready ]]; then
  say "qemu start -> rxe ready: $(awk -v a="$T_QEMU" -v b="$(date -r "$RUN/ready" +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s (in guest: $(tr '\n' ' ' < "$RUN/timings" 2>/dev/null))"
fi
if [[ -f $RUN/rc ]]; then
  rc=$(cat "$RUN/rc")
  if [[ ! -f $RUN/ready ]]; then echo "[rxe-vm] rxe setup failed in the VM; setup log:" >&2; cat "$RUN/setup.log" >&2; fi
  say "script exit code: $rc (total wall $(elapsed) s)"
  exit "$rc"
fi
if grep -qi "could not access KVM\|failed to initialize kvm\|Could not initialize" "$RUN/qemu.log" 2>/dev/null; then
  cat "$RUN/qemu.log" >&2
  cannot "qemu could not start (see above)"
fi
echo "[rxe-vm] VM ended without an exit code (qemu rc=$qrc; 124 = RXE_VM_TIMEOUT hit). Setup log:" >&2
cat "$RUN/setup.log" >&2 2>/dev/null || true
echo "[rxe-vm] console tail:" >&2; tail -n 40 "$RUN/console.log" >&2 || true
cat "$RUN/qemu.log" >&2 || true
exit 125
