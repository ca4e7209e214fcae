#!/bin/bash
# Core's files call each other one way (docs/ARCHITECTURE.md): for
# every pair of src/core files, at most one calls the other by name.  An
# upcall goes through a documented callback table (a function pointer,
# which no symbol table shows), never by name.
#
# Usage: one_way.sh OBJECT...   (the library's objects; CMake passes
# $<TARGET_OBJECTS:kvferry_obj>).  Reads each src/core object's symbols
# with nm: what it defines, what it calls from elsewhere; fails naming
# every pair of files that call each other, and the calls.
set -euo pipefail
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
rc=0
while read -r a b; do
    [ -n "$a" ] || continue
    echo "FAIL: src/core/$a.c and src/core/$b.c call each other:"
    grep -E "^($a $b|$b $a) " <<<"$edges" | awk '{print "  " $1 ".c -> " $2 ".c: " $3}'
    rc=1
done <<<"$found"
[ $rc -eq 0 ] && echo "ok: $(grep -c . <<<"$pairs") pairs of src/core files where one calls the other, none both ways"
exit $rc
