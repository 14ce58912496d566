#!/bin/busybox sh
# Stage 1 (PID 1 inside the initramfs built by rxe_vm.sh).
# Mounts the host's / (9p, read-only) under a tmpfs overlay so the guest sees the
# host filesystem writable-in-RAM, mounts the per-run output share, then hands
# over to stage 2 (guest_stage2.sh, copied into the output share by rxe_vm.sh).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

die() { echo "rxe-vm stage1: $*" >/dev/console; dmesg | tail -5 >/dev/console; echo o >/proc/sysrq-trigger; sleep 10; }

# /mod/order: module files in dependency order (from modprobe --show-depends at build time)
while read -r m; do insmod "/mod/$m" 2>/dev/null; done < /mod/order

mkdir -p /lower /rw /newroot
# msize: bigger 9p messages = much faster reads of binaries/libraries
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower \
  || die "mount of 9p hostroot failed"
mount -t tmpfs -o size=50% tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
  || die "overlay mount failed"

mkdir -p /newroot/rxe-vm-out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 rxeout /newroot/rxe-vm-out \
  || die "mount of 9p rxeout failed"

# optional extra read-write share of a host directory at the same path
if grep -q rxe_rw= /proc/cmdline; then
  rw=$(sed -n 's/.*rxe_rw=\([^ ]*\).*/\1/p' /proc/cmdline)
  mkdir -p "/newroot$rw"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 hostrw "/newroot$rw" \
    || die "mount of 9p hostrw failed"
fi

[ -f /newroot/rxe-vm-out/stage2.sh ] || die "stage2.sh missing in output share"
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /bin/sh /rxe-vm-out/stage2.sh
