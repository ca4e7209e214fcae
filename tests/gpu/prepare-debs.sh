#!/usr/bin/env bash
# Bring the Debian packages the device check needs, for a GPU machine that
# has CUDA and PyTorch but no package registry (tests/gpu/run.sh unpacks
# them there into a local prefix, and uses each only where the machine
# lacks it).  Run here, on a machine with apt and a registry:
#
#   tests/gpu/prepare-debs.sh [DIR]      (default tests/gpu/debs)
#   WITH_GCC=1 tests/gpu/prepare-debs.sh  (bring gcc and binutils as well)
#
# It downloads (apt-get download: no root, nothing installed) the build
# tools and the -dev packages of kvferry's dependencies, and the libraries
# they depend on, but not the base system (libc, the compiler runtime):
# those must come from the GPU machine itself, or its own binaries would
# break.  The packages match this machine's distribution (Debian 12 here);
# run it on the distribution the GPU machine has.
set -euo pipefail
dir=${1:-$(dirname "$0")/debs}
mkdir -p "$dir"
cd "$dir"

want=(cmake cmake-data make pkgconf pkgconf-bin libpkgconf3
      libmicrohttpd-dev libmicrohttpd12 libcurl4-openssl-dev libcurl4
      libjansson-dev libjansson4 libxxhash-dev libxxhash0 libssl-dev libssl3)
# A compiler too (WITH_GCC=1): a machine with the CUDA toolkit has one, and
# gcc's closure triples the download (about 90 MB instead of 30).
[ "${WITH_GCC:-0}" = 1 ] && want+=(gcc)
# Never brought along: what every system has, in the version its own
# binaries were built against.
base='^(libc6|libc6-dev|libc-dev-bin|libgcc-s1|libstdc\+\+6|gcc-[0-9]+-base|libcrypt1|linux-libc-dev|debconf|dpkg|perl-base|tar|zlib1g|libzstd1|liblzma5|libbz2-1.0|libselinux1|libpcre2-8-0|libgmp10|libtinfo6|libgnutls30|libp11-kit0|libtasn1-6|libnettle8|libhogweed6|libidn2-0|libunistring2|libffi8)$'
mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances "${want[@]}" |
    grep -E '^[a-z0-9]' | sort -u | grep -Ev "$base")
echo "prepare-debs: ${#pkgs[@]} packages into $(pwd)"
apt-get download "${pkgs[@]}"
ls -1 ./*.deb | wc -l
