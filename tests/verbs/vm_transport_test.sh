#!/bin/bash
# Runs inside the rxe VM (rxe_vm.sh): test_verbs_transport between two
# processes, rank 0 on the A side, rank 1 on the B side. With 4 devices it
# runs three times: two roots per rank (rank 0: rxe0,rxe2; rank 1:
# rxe1,rxe3), one root (rxe0, rxe1), then a ring of 2 (--ring), each rank's
# list the port facing prev, then the port facing next, two roots on each:
# rank 0's next port is rxe0, cabled (veth0-veth1) to rank 1's prev port
# rxe1; rank 1's next port rxe3 to rank 0's prev port rxe2 (veth3-veth2).
# Soft-RoCE has one device per netdev, so a port's two roots are the one
# device opened twice.
#   rxe_vm.sh tests/verbs/vm_transport_test.sh BINARY [extra test args]
BIN=$1; shift
rc=0
run() { # title hca0 hca1 roots [args]
  local title=$1 hca0=$2 hca1=$3 roots=$4; shift 4
  echo "=== $title: rank 0 on $hca0, rank 1 on $hca1"
  local tx0 tx1 t0=$(date +%s.%N)
  read -r tx0 < /sys/class/net/veth0/statistics/tx_packets
  timeout -k 5 900 "$BIN" --hca0 "$hca0" --hca1 "$hca1" --roots "$roots" \
    --gid0 "${GID0:-$RXE_GID_A}" --gid1 "${GID1:-$RXE_GID_B}" "$@" || rc=1
  read -r tx1 < /sys/class/net/veth0/statistics/tx_packets
  echo "=== $title: veth0 sent $((tx1 - tx0)) packets; $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
}
if [[ ${RXE_NDEV:-2} == 4 ]]; then
  run "two roots" "$RXE_DEV_A,$RXE_DEV_C" "$RXE_DEV_B,$RXE_DEV_D" 2 "$@"
  run "one root" "$RXE_DEV_A" "$RXE_DEV_B" 1 --burst 2000 "$@"
  # The GID checks look at each rank's first device: rank 0's is rxe2 now.
  GID0=$RXE_GID_C run "ring" "$RXE_DEV_C,$RXE_DEV_C,$RXE_DEV_A,$RXE_DEV_A" "$RXE_DEV_B,$RXE_DEV_B,$RXE_DEV_D,$RXE_DEV_D" \
    2 --ring --burst 2000 "$@"
else
  run "one root" "$RXE_DEV_A" "$RXE_DEV_B" 1 "$@"
fi
rdma statistic show link "$RXE_DEV_A/1" 2>/dev/null
exit $rc
