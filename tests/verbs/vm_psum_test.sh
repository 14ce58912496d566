#!/bin/bash
# Runs inside the rxe VM (rxe_vm.sh): jax_arx.psum, and in one phase the bulk
# collectives, between two processes over the verbs carrier,
# tests/workers/verbs_psum.py, rank 0 on the A side, rank 1 on the B side.
#   rxe_vm.sh tests/verbs/vm_psum_test.sh PYTHON WORKER [--ranks N] [--phase ... to replace the default phases]
# --ranks N: N processes instead of two (their devices come with the phases).
# PYTHON must have jax (CPU) and jax_arx installed; the VM sees the host's
# filesystem read-only at the same paths.
#
# Each rank runs in its own UTS namespace with its own hostname, so jax_arx
# takes the two processes for two hosts: the automatic transport choice then
# has to pick verbs where both ranks name their devices (JAX_ARX_IB_HCA),
# and tcp where one does not (soft-RoCE devices are never picked unasked).
# The explicit phases (JAX_ARX_TRANSPORT=verbs) do not depend on it.
PY=$1 WORKER=$2; shift 2
RANKS=2
if [[ ${1:-} == --ranks ]]; then RANKS=$2; shift 2; fi
A=$RXE_DEV_A B=$RXE_DEV_B
if (($#)); then
  PHASES=("$@")
else
  # The bulk collectives (bulk=N calls of each) on two roots where there are
  # two, else on the one.
  PHASES=()
  C=$RXE_DEV_C D=$RXE_DEV_D
  if [[ ${RXE_NDEV:-2} == 4 ]]; then
    PHASES+=(--phase "name=two-roots transport=verbs hca=$A,$C/$B,$D expect=verbs calls=4 bulk=10")
    # A ring of 2: each rank's list names the port facing prev, then the port
    # facing next (two roots each: soft-RoCE has one device per netdev, opened
    # twice). Rank 0's next port rxe0 is wired to rank 1's prev port rxe1,
    # rank 1's next port rxe3 to rank 0's prev port rxe2.
    PHASES+=(--phase "name=ring transport=verbs topology=ring hca=$C,$C,$A,$A/$B,$B,$D,$D expect=verbs calls=2"
             --phase "name=one-root transport=verbs hca=$A/$B expect=verbs chunk=64KiB calls=2")
  else
    PHASES+=(--phase "name=one-root transport=verbs hca=$A/$B expect=verbs chunk=64KiB calls=4 bulk=10")
  fi
  PHASES+=(--phase "name=auto-verbs transport=auto hca=$A/$B expect=verbs calls=2"
           --phase "name=auto-tcp transport=auto hca=$A/- expect=tcp calls=2"
           --phase "name=lose-peer transport=verbs hca=$A/$B expect=verbs lose=1")
fi
# Under TCG a vCPU can stall past the default 67 ms QP timeout; this rxe
# retries forever at retry count 7 (see docs/roce.md).
export JAX_PLATFORMS=cpu JAX_ARX_IB_TIMEOUT=16 JAX_ARX_IB_RETRY_CNT=6 JAX_ARX_TIMEOUT_S=60 PYTHONUNBUFFERED=1
export JAX_COORDINATOR_ADDRESS=127.0.0.1:47611 JAX_NUM_PROCESSES=$RANKS
unset JAX_ARX_TRANSPORT JAX_ARX_IB_HCA NCCL_IB_HCA
# jax's CPU client (gloo) resolves its hostname; /etc/hosts is the host's, under
# the VM's RAM overlay, so the names can be added here.
echo "127.0.0.1 $(for ((r = 0; r < RANKS; r++)); do printf 'arx-host-%d ' $r; done)$(cat /proc/sys/kernel/hostname)" >> /etc/hosts
echo "=== $A device link: $(readlink /sys/class/infiniband/$A/device 2>/dev/null || echo none) (soft-RoCE: none)"
read -r tx0 < /sys/class/net/veth0/statistics/tx_packets
t0=$(date +%s.%N)
RCS=$(mktemp -d)
for ((rank = 0; rank < RANKS; rank++)); do
  { JAX_PROCESS_ID=$rank timeout -k 5 2300 unshare --uts /bin/sh -c \
      'echo "arx-host-$JAX_PROCESS_ID" > /proc/sys/kernel/hostname && exec "$@"' sh \
      "$PY" "$WORKER" "${PHASES[@]}"; echo $? > "$RCS/$rank"; } 2>&1 | sed -u "/^verbs_psum: /!s/^/[rank $rank] /" &
done
wait
rc=0
for ((rank = 0; rank < RANKS; rank++)); do
  r=$(cat "$RCS/$rank" 2>/dev/null || echo missing)
  [[ $r == 0 ]] || { echo "=== rank $rank exited with $r"; rc=1; }
done
read -r tx1 < /sys/class/net/veth0/statistics/tx_packets
echo "=== psum over verbs: veth0 sent $((tx1 - tx0)) packets; $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
exit $rc
