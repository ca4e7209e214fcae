#!/usr/bin/env bash
# Fault matrix on real sizes, stop-decode: SIGSTOP decode rank 0 (SIGCONT once its peers resolved its rooms)
# at "mid", while a 128 MiB chunk of llama3-8b KV is on its way (fault_big
# in fault_lib.sh: far more than a decode rank keeps in flight), over
# every transport.  Every room must end SUCCESS or FAILED with a reason,
# within 5 s, and the survivors must then serve fresh rooms (fault_lib.sh,
# fault_check.py).  Release build only (fault_big_gate).
set -euo pipefail
source "$(dirname "$0")/fault_lib.sh"
fault_big_gate
fault_big
fault_matrix stop-decode mid
