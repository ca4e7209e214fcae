#!/usr/bin/env bash
# The last step of `make test`: run ctest in each build named on the command
# line, go on past a build whose tests fail, and end with one line that adds
# up every build ("kvferry: N passed, M failed"), so that a failure in the
# first build does not hide the state of the others.
#
#   tests/suite.sh NAME=DIR [NAME=DIR ...]
#
# NAME picks how the build's tests run: release (everything), asan (address
# and undefined sanitizers, leaks included), tsan (thread sanitizer), fuzz
# (the libFuzzer targets only).  CTEST_ARGS adds ctest options to each run.
set -u
pass=0 fail=0 summary=()
for spec in "$@"; do
    name=${spec%%=*} dir=${spec#*=}
    env=() args=() reports=
    case $name in
        release) ;;
        asan) env=(ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
                   UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1) ;;
        # Reports go to files: several tests send their helpers' stderr to
        # /dev/null or a scratch directory, and some expect a helper to die,
        # so neither the output nor an exit status would surely show a race.
        tsan) reports=$(cd "$dir" && pwd)/tsan-reports
              rm -rf "$reports" && mkdir -p "$reports" || exit 2
              env=(TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:log_path=$reports/report) ;;
        fuzz) args=(-R '^fuzz\.') ;;
        *) echo "suite.sh: unknown build kind '$name'" >&2; exit 2 ;;
    esac
    log=$dir/ctest-suite.log
    echo "=== $name build ($dir) ==="
    # shellcheck disable=SC2086
    (cd "$dir" && env "${env[@]}" ctest ${CTEST_ARGS:-} "${args[@]}") 2>&1 | tee "$log"
    line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
    if [ -z "$line" ]; then
        summary+=("$name: ctest did not finish")
        fail=$((fail + 1))
        continue
    fi
    f=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
    t=$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"$line")
    pass=$((pass + t - f)) fail=$((fail + f))
    summary+=("$name: $((t - f))/$t")
    if [ -n "$reports" ]; then
        n=$(find "$reports" -type f | wc -l)
        if [ "$n" -gt 0 ]; then
            # One failure per process TSan stopped, on top of its test's own
            # verdict: a helper's race may leave its test passing.
            head -n 60 "$reports"/* | tee -a "$log"
            echo "$name: $n process(es) stopped by TSan, reports in $reports"
            fail=$((fail + n))
            summary+=("$name: $n TSan report(s)")
        fi
    fi
done
echo
(IFS=,; echo "=== totals: ${summary[*]} ===")
echo "kvferry: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
