#!/usr/bin/env bash
# Siblings, prefill TP 2 -> decode TP 2 over tcp: prefill rank k feeds
# decode rank k only, so pair 1 moves every byte of a room while pair 0
# is killed, stopped, reset or corrupted; every rank of both pairs must
# end the room FAILED (or, where the other side had every byte, that side
# SUCCESS) and name the root cause (siblings_lib.sh, fault_check.py).
set -euo pipefail
source "$(dirname "$0")/siblings_lib.sh"
sibling_matrix tcp "--prefill-tp 2 --decode-tp 2" \
    kill-prefill@mid kill-decode@mid stop-prefill@mid stop-decode@last reset@mid corrupt@mid
