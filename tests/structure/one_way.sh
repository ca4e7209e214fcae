#!/bin/bash
# Core's files call each other one way (issue: "events one way"): for
# every pair of src/core files, at most one calls the other by name.  An
# upcall goes through a documented callback table (a function pointer,
# which no symbol table shows), never by name.
#
# Usage: one_way.sh OBJECT...   (the library's objects; CMake passes
# $<TARGET_OBJECTS:kvferry_obj>).  Reads each src/core object's symbols
# with nm: what it defines, what it calls from elsewhere.  Pairs listed
# in one_way.allow (one "a b" per line, sorted, with a why) are still
# tolerated; the test fails on any other pair, and on an allowed pair
# that no longer calls both ways, so the list only shrinks.
set -euo pipefail
allow="$(dirname "$0")/one_way.allow"
objs=()
for o in "$@"; do
    case "$o" in */src/core/*.o) objs+=("$o") ;; esac
done
[ ${#objs[@]} -gt 0 ] || { echo "no src/core objects given" >&2; exit 2; }
# "unit defined|undefined symbol" for every object, then who calls whom.
edges=$(for o in "${objs[@]}"; do
    u=$(basename "$o" .c.o)
    nm --defined-only -g "$o" | awk -v u="$u" '{print u, "D", $3}'
    nm -u "$o" | awk -v u="$u" '{print u, "U", $2}'
done | awk '$2 == "D" {owner[$3] = $1; next}
            {use[NR] = $1 " " $3}
            END {for (i in use) {split(use[i], f, " ");
                     if ((f[2] in owner) && owner[f[2]] != f[1])
                         print f[1], owner[f[2]], f[2]}}' | sort -u)
pairs=$(awk '{print $1, $2}' <<<"$edges" | sort -u)
found=$(awk '{seen[$1 " " $2] = 1}
             END {for (k in seen) {split(k, f, " ");
                      if (f[1] < f[2] && ((f[2] " " f[1]) in seen)) print k}}' \
        <<<"$pairs" | sort)
allowed=$( { grep -v '^#' "$allow" 2>/dev/null || true; } | awk 'NF {print $1, $2}' | sort -u)
rc=0
while read -r a b; do
    [ -n "$a" ] || continue
    grep -qx "$a $b" <<<"$allowed" && continue
    echo "FAIL: src/core/$a.c and src/core/$b.c call each other:"
    grep -E "^($a $b|$b $a) " <<<"$edges" | awk '{print "  " $1 ".c -> " $2 ".c: " $3}'
    rc=1
done <<<"$found"
while read -r a b; do
    [ -n "$a" ] || continue
    grep -qx "$a $b" <<<"$found" && continue
    echo "FAIL: $a $b is in one_way.allow but no longer calls both ways: remove the line"
    rc=1
done <<<"$allowed"
[ $rc -eq 0 ] && echo "ok: $(wc -l <<<"$found" | tr -d ' ') allowed two-way pairs left, no other"
exit $rc
