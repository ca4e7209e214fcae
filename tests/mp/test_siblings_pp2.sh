#!/usr/bin/env bash
# Siblings, two pipeline stages on both sides (prefill PP 2 -> decode PP 2)
# over shm: stage s of prefill feeds stage s of decode only, so the other
# stage's pair moves its layers untouched while stage 0's is hit; every
# rank of both stages must end the room as one and name the root cause
# (siblings_lib.sh).
set -euo pipefail
source "$(dirname "$0")/siblings_lib.sh"
sibling_matrix shm "--prefill-pp 2 --decode-pp 2" \
    kill-prefill@bootstrap kill-decode@last stop-prefill@mid stop-decode@bootstrap \
    reset@bootstrap corrupt@mid
