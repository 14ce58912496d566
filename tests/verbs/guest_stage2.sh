#!/bin/sh
# Stage 2: PID 1 inside the VM (root = the host's / read-only under a RAM
# overlay). Sets up 2, 4 or 8 soft-RoCE devices over veth pairs, runs the
# user's script, records its exit code in the per-run share, powers off.
# Under TCG every exec costs ~0.1 s, so this prefers builtins and batch modes.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
O=/rxe-vm-out
exec >$O/setup.log 2>&1 </dev/null
set +e
read T2 _ < /proc/uptime
finish() { echo "$1" > $O/rc; sync; echo o > /proc/sysrq-trigger; sleep 30; }

mount -t tmpfs tmpfs /run     # /tmp stays the host's /tmp (writes go to the RAM overlay)
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
ulimit -l unlimited
echo rxe-vm > /proc/sys/kernel/hostname
modprobe -a rdma_rxe veth || { echo "modprobe rdma_rxe veth failed"; finish 126; }
# RoCE v2 GIDs come from the IPv4 addresses; no IPv6 GIDs, to keep the tables short
echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6
echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6

read CMDLINE < /proc/cmdline
NDEV=2; case " $CMDLINE " in *" rxe_ndev=4 "*) NDEV=4;; *" rxe_ndev=8 "*) NDEV=8;; esac

# RFC 5737 TEST-NET-2; the VM has no NIC (-nic none), so nothing here leaves it.
# Pair k (k = 0 .. NDEV/2 - 1): veth(2k) <-> veth(2k+1) with addresses
# .(2k+1), .(2k+2), rxe(i) on veth(i). Both ends stay
# in the initial network namespace: the 6.1 kernel's rxe sends and receives
# only there. Policy routing makes traffic between the two local addresses
# really cross the wire: locally generated packets to an address use a
# per-destination table pointing at the other veth end, the 'local' table is
# demoted below those rules, and accept_local + rp_filter=0 let the far end
# take packets from a local source address.
echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter
echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter
pair() { # a b ip_a ip_b table_base
  ip link add $1 type veth peer name $2 || finish 126
  for d in $1 $2; do
    echo 0 > /proc/sys/net/ipv4/conf/$d/rp_filter
    echo 1 > /proc/sys/net/ipv4/conf/$d/accept_local
  done
  read MA < /sys/class/net/$1/address; read MB < /sys/class/net/$2/address
  ip -batch - <<EOF || finish 126
addr add $3/32 dev $1
addr add $4/32 dev $2
link set $1 up
link set $2 up
rule add pref $5 iif lo to $4 lookup $5
rule add pref $(($5 + 1)) iif lo to $3 lookup $(($5 + 1))
route add $4 dev $1 src $3 table $5
route add $3 dev $2 src $4 table $(($5 + 1))
neigh replace $4 lladdr $MB dev $1 nud permanent
neigh replace $3 lladdr $MA dev $2 nud permanent
EOF
}
ip -batch - <<EOF || finish 126
link set lo up
rule add pref 1000 lookup local
rule del pref 0
EOF
NET=198.51.100
A=$NET.1 B=$NET.2 C=$NET.3 D=$NET.4
k=0; while [ $((2 * k)) -lt $NDEV ]; do
  pair veth$((2 * k)) veth$((2 * k + 1)) $NET.$((2 * k + 1)) $NET.$((2 * k + 2)) $((100 + 2 * k))
  k=$((k + 1))
done
i=0; while [ $i -lt $NDEV ]; do echo "link add rxe$i type rxe netdev veth$i"; i=$((i + 1)); done | rdma -b - || finish 126

# The RoCE v2 GID holding the device's IPv4 address (the table fills
# asynchronously). jax_arx finds the same one by itself; the test checks that.
gid_index() { # dev ipv4 -> sets GID
  IFS=. read o1 o2 o3 o4 <<EOF
$2
EOF
  hex=$(printf '%02x%02x:%02x%02x' $o1 $o2 $o3 $o4); GID=
  for g in /sys/class/infiniband/$1/ports/1/gids/*; do
    read v < $g 2>/dev/null
    case $v in *:ffff:$hex)
      i=${g##*/}; t=; read t < /sys/class/infiniband/$1/ports/1/gid_attrs/types/$i 2>/dev/null
      [ "$t" = "RoCE v2" ] && { GID=$i; return; };;
    esac
  done
}
n=0; while [ $n -lt 100 ]; do
  ok=1; dv=0  # not i: gid_index sets i (sh functions share the caller's variables)
  while [ $dv -lt $NDEV ]; do
    gid_index rxe$dv $NET.$((dv + 1)); [ -n "$GID" ] || ok=0
    export RXE_DEV_$dv=rxe$dv RXE_IP_$dv=$NET.$((dv + 1)) RXE_GID_$dv=$GID
    dv=$((dv + 1))
  done
  [ $ok = 1 ] && break
  sleep 0.1; n=$((n+1))
done
[ $ok = 1 ] || { echo "no RoCE v2 IPv4 GID on the rxe devices"; finish 126; }
export RXE_NDEV=$NDEV RXE_DEV_A=rxe0 RXE_DEV_B=rxe1 RXE_IP_A=$A RXE_IP_B=$B RXE_GID_A=$RXE_GID_0 RXE_GID_B=$RXE_GID_1
[ $NDEV -ge 4 ] && export RXE_DEV_C=rxe2 RXE_DEV_D=rxe3 RXE_IP_C=$C RXE_IP_D=$D RXE_GID_C=$RXE_GID_2 \
  RXE_GID_D=$RXE_GID_3
rdma link
env | grep ^RXE_
read T3 _ < /proc/uptime
: > $O/ready   # the host takes this file's mtime as 'VM ready'

read d < $O/cwd; cd "$d" 2>/dev/null || cd /
SH=/bin/sh; [ -x /bin/bash ] && SH=/bin/bash
set --; while IFS= read -r a; do set -- "$@" "$a"; done < $O/args   # one arg per line
$SH $O/user-script "$@" >>$O/output 2>&1
rc=$?
read T4 _ < /proc/uptime
awk -v a=$T2 -v b=$T3 -v c=$T4 'BEGIN{printf "kernel_boot_to_stage2=%.2fs setup=%.2fs script=%.2fs\n", a, b-a, c-b}' > $O/timings
finish $rc
