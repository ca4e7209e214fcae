#!/usr/bin/env bash
# Fault matrix, badaddr: prefill rank 0's engine names, in one pulled
# segment, a source address outside every region it registered (a buggy or
# lying sender), at the start of the first room, in its middle and in its
# last chunk.  The decode side checks every source before it reads: the
# read is refused, that room alone fails with the reason on both sides,
# and every other room on the same peer, in flight beside it or after it,
# succeeds byte for byte (docs/FAILURES.md, "a source outside the sender's
# memory").  Pushed payload (tcp) names no source, so only the pull
# transports run it.
set -euo pipefail
source "$(dirname "$0")/fault_lib.sh"
FAULT_TRANSPORTS=${FAULT_TRANSPORTS/tcp/}
fault_matrix badaddr
