#!/usr/bin/env bash
# Siblings, two prefill DP groups (room % 2 picks one) over tcp, prefill
# TP 2 -> decode TP 2: a fault on prefill rank 0 (DP group 0) fails that
# group's rooms on every rank of both sides, naming the cause, while the
# other group's rooms succeed byte for byte on the same decode ranks; a
# fault on decode rank 0 reaches both groups (siblings_lib.sh).  Seed 4
# puts the first two rooms (and 2 of 4 in the fresh batch) in group 0:
# the fault's trigger rank, prefill rank 0, runs them.
set -euo pipefail
source "$(dirname "$0")/siblings_lib.sh"
sibling_matrix tcp "--dp 2 --prefill-tp 2 --decode-tp 2 --seed 4" \
    kill-prefill@mid kill-decode@bootstrap stop-prefill@last stop-decode@mid reset@mid \
    corrupt@bootstrap
