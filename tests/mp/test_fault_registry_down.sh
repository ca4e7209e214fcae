#!/usr/bin/env bash
# Fault matrix, registry-down: kill the bootstrap registry (restarted on the same port)
# when the first room is bootstrapping, mid-transfer and at its last chunk.
# Every room must end SUCCESS or FAILED with a reason, within 5 s, and the
# survivors must then serve fresh rooms (fault_lib.sh, fault_check.py).
set -euo pipefail
source "$(dirname "$0")/fault_lib.sh"
fault_matrix registry-down
