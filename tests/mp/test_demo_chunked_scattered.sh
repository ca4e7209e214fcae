#!/usr/bin/env bash
# kvferry demo, llama3-8b layout (64 K/V buffers), 4 rooms of 256 tokens
# sent in 64-token chunks into randomly scattered decode pages.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

out=$(timeout 240 "$KVFERRY" demo --json --model llama3-8b --requests 4 \
      --tokens 256 --chunk 64 --timeout 200)
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["scattered"] is True and d["chunk"] == 64, d
assert d["succeeded"] == 4 and d["failed"] == 0 and d["unresolved"] == 0, d
assert d["verified"] is True, d
# 4 rooms x 256 tokens x 32 layers x (K+V) x 8 heads x 128 x 2 bytes
assert d["bytes"] == 4 * 256 * 32 * 2 * 8 * 128 * 2, d["bytes"]
print("ok: llama3-8b, 4 rooms in 64-token chunks, scattered pages, %d bytes verified" % d["bytes"])
' "$out"
