#!/usr/bin/env bash
# Siblings, prefill TP 4 -> decode TP 4 over shm: four independent pairs,
# one of them hit by each fault; every rank of the other three must end
# the room as the hit pair does and name its root cause (siblings_lib.sh).
set -euo pipefail
source "$(dirname "$0")/siblings_lib.sh"
sibling_matrix shm "--prefill-tp 4 --decode-tp 4" \
    kill-prefill@last kill-decode@mid stop-prefill@bootstrap stop-decode@mid reset@last \
    corrupt@last
