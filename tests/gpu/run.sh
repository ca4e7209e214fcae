#!/usr/bin/env bash
# The device check: on a machine with one NVIDIA GPU, CUDA and PyTorch,
# and no package registry, build kvferry and run, in about five minutes:
#
#   1. the build (the cuda component on); test_cuda (the real driver's
#      pointer kinds, a staged room in device memory, sent whole and
#      layer by layer); test_memkind and test_stage (their logic, on the
#      fake driver); the Python memory tests (with torch here: a CUDA
#      tensor registers);
#   2. two processes on the GPU, rooms over the cuda mover (IPC), checked
#      byte for byte on the device, at 64 KiB and 4 KiB segments;
#   3. GPU to host and host to GPU (staged tcp, one side), and staged tcp
#      GPU to GPU, and host to host tcp (the baseline);
#   4. torch's cudaMemcpy D2D, D2H, H2D of the same bytes, in the same run;
#   5. a summary against the issue's targets.
#
#   timeout 900 tests/gpu/run.sh            (results under $OUT, or build-gpu/out)
#
# tests/gpu/debs is not committed (git ignores it): prepare it here with
# prepare-debs.sh and carry it to the GPU machine with the tree (about 45
# MB without gcc).
#
# Safe to run once as one command: every step has its own timeout, every
# process it starts is killed on exit, nothing is fetched from a network,
# and a step that fails is reported and the next one still runs.  Debian
# packages the machine lacks come from tests/gpu/debs (tests/gpu/
# prepare-debs.sh), unpacked into build-gpu/prefix and used only for what
# the system does not have.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$root/build-gpu
out=${OUT:-$work/out}
mkdir -p "$work" "$out"
log=$out/run.log
exec > >(tee -a "$log") 2>&1
pids=()
cleanup() { for p in "${pids[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; }
trap cleanup EXIT INT TERM
status=0
step() { echo; echo "=== $* ($(date -u +%T))"; }
fail() { echo "FAILED: $*"; status=1; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
            "devices", torch.cuda.device_count())' 2>&1 || fail "no torch"

step "prefix from tests/gpu/debs (only what the system lacks)"
prefix=$work/prefix
if ls "$root"/tests/gpu/debs/*.deb >/dev/null 2>&1; then
    mkdir -p "$prefix"
    for d in "$root"/tests/gpu/debs/*.deb; do dpkg-deb -x "$d" "$prefix" 2>/dev/null ||
        (cd "$prefix" && ar p "$d" data.tar.xz | tar xJ) ; done
    triplet=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
    export PKG_CONFIG_SYSROOT_DIR=$prefix
    export PKG_CONFIG_PATH=$prefix/usr/lib/$triplet/pkgconfig:$prefix/usr/share/pkgconfig
    # Tools from the prefix only where the system has none: it comes last
    # on the PATH (and is called by its own path, so gcc and cmake find
    # their libexec and modules beside it).
    export PATH=$PATH:$prefix/usr/bin
    # Libraries: only those the dynamic linker cannot find already.
    mkdir -p "$work/lib"
    have=$(ldconfig -p 2>/dev/null | awk 'NR > 1 {print $1}')
    for f in "$prefix"/usr/lib/"$triplet"/lib*.so.*; do
        b=$(basename "$f")
        [[ $b =~ \.so\.[0-9]+$ ]] || continue        # sonames only
        grep -qxF "$b" <<<"$have" || ln -sf "$f" "$work/lib/$b"
    done
    export LD_LIBRARY_PATH=$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "prefix: $(ls "$work/lib" | wc -l) libraries the system lacks;" \
         "tools: $(for t in cmake make pkg-config gcc; do printf '%s=%s ' $t "$(command -v $t)"; done)"
else
    echo "no tests/gpu/debs: using the system's packages"
fi

step "build"
timeout 300 cmake -S "$root" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DKVF_CUDA=ON \
    -DKVF_UCX=OFF -DKVF_WERROR=OFF >"$out/cmake.log" 2>&1 || fail "cmake (see cmake.log)"
timeout 300 cmake --build "$work/build" -j"$(nproc)" >"$out/build.log" 2>&1 ||
    fail "build (see build.log)"
tail -n 3 "$out/build.log"
lib=$work/build/libkvferry.so
[ -f "$lib" ] || { echo "no library: stopping"; exit 1; }
export KVFERRY_LIBRARY=$lib

step "unit tests: test_cuda on the real GPU, the others on the fake driver"
for t in test_cuda test_memkind test_stage; do
    timeout 120 "$work/build/tests/$t" >"$out/$t.log" 2>&1 || fail "$t (see $t.log)"
    tail -n 1 "$out/$t.log"
done
(cd "$root/python/tests" && timeout 120 python3 -m unittest -v test_memory) \
    >"$out/py_memory.log" 2>&1 || fail "python test_memory (see py_memory.log)"
tail -n 3 "$out/py_memory.log"

# One prefill/decode pair of processes; the decode's JSON line goes to $out.
pair() {
    local name=$1; shift
    local pf=$work/$name.port
    rm -f "$pf"
    timeout 120 python3 "$root/tests/gpu/gpu_rooms.py" prefill --port-file "$pf" "$@" \
        >"$out/$name.prefill.log" 2>&1 &
    local pp=$!
    pids+=("$pp")
    for _ in $(seq 600); do [ -s "$pf" ] && break; kill -0 "$pp" 2>/dev/null || break;
                            sleep 0.1; done
    if [ ! -s "$pf" ]; then fail "$name: prefill did not start"; tail -5 "$out/$name.prefill.log"; return; fi
    timeout 120 python3 "$root/tests/gpu/gpu_rooms.py" decode --bootstrap "$(cat "$pf")" "$@" \
        >"$out/$name.json" 2>"$out/$name.decode.log" || fail "$name (see $name.*.log)"
    wait "$pp" || fail "$name: prefill exit status"
    cat "$out/$name.json"
}

step "rooms: two processes on one GPU"
pair ipc64k     --mode ipc      --seg 65536 --pages 4096
pair ipc4k      --mode ipc      --seg 4096  --pages 32768
pair staged64k  --mode staged   --seg 65536 --pages 4096
pair gpu2host   --mode gpu2host --seg 65536 --pages 4096
pair host2gpu   --mode host2gpu --seg 65536 --pages 4096
pair host64k    --mode host     --seg 65536 --pages 4096

step "cudaMemcpy of the same bytes"
for seg in 65536 4096; do
    timeout 120 python3 "$root/tests/gpu/copy_bench.py" --bytes $((256 << 20)) --seg $seg \
        >"$out/copy$seg.json" 2>&1 || fail "copy_bench $seg"
    cat "$out/copy$seg.json"
done

step "summary against the targets"
python3 - "$out" <<'PY' || status=1
import json, os, sys
out = sys.argv[1]
def rows(name):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        return []
    return [json.loads(l) for l in open(p) if l.startswith("{")]
def one(name):
    r = rows(name)
    return r[0] if r else None
copy = {(r["copy"], r["seg"]): r for n in ("copy65536.json", "copy4096.json") for r in rows(n)}
ok = True
def check(what, got, ref, ratio):
    global ok
    if got is None or ref is None:
        print("%-44s not measured" % what); ok = False; return
    r = got["GBps"] / ref["GBps"]
    good = r >= ratio
    ok &= good
    print("%-44s %6.2f GB/s vs %6.2f GB/s = %.2fx (target %.1fx) %s"
          % (what, got["GBps"], ref["GBps"], r, ratio, "ok" if good else "BELOW"))
for n in ("ipc64k", "ipc4k", "staged64k", "gpu2host", "host2gpu", "host64k"):
    r = one(n + ".json")
    if r is None or r.get("bad_rooms"):
        print("%s: %s" % (n, "no result" if r is None else "%d rooms differ" % r["bad_rooms"]))
        ok = False
check("ipc, 64 KiB segments vs cudaMemcpy D2D", one("ipc64k.json"), copy.get(("d2d", 65536)), 0.8)
check("ipc, 4 KiB segments vs cudaMemcpy D2D", one("ipc4k.json"), copy.get(("d2d", 4096)), 0.5)
d2h, host = copy.get(("d2h", 65536)), one("host64k.json")
slower = min((x for x in (d2h, host) if x), key=lambda x: x["GBps"], default=None)
check("staged tcp vs min(D2H, kvferry host tcp)", one("staged64k.json"), slower, 0.8)
json.dump({"ok": ok}, open(os.path.join(out, "summary.json"), "w"))
sys.exit(0 if ok else 1)
PY
echo
echo "device check: $([ $status -eq 0 ] && echo PASSED || echo FAILED) (log: $log)"
exit $status
