#!/bin/bash
# Runs inside the rxe VM (rxe_vm.sh): every part of tests/test_verbs.py that
# needs the VM's four devices, in one boot: the carrier alone
# (vm_transport_test.sh), then jax_arx over it (vm_psum_test.sh). Each
# part's output comes between "=== part NAME" and "=== part NAME: exit N";
# a part that fails does not stop the next.
#   rxe_vm.sh tests/verbs/vm_suite.sh VERBS_DIR BINARY PYTHON WORKER
# VERBS_DIR: this folder (the VM runs a copy of this script, elsewhere).
DIR=$1 BIN=$2 PY=$3 WORKER=$4
rc=0
part() { # name script args...
  local name=$1; shift
  echo "=== part $name"
  bash "$@"
  local r=$?
  echo "=== part $name: exit $r"
  ((r == 0)) || rc=1
}
part transport "$DIR/vm_transport_test.sh" "$BIN"
part psum "$DIR/vm_psum_test.sh" "$PY" "$WORKER"
exit $rc
