#!/usr/bin/env bash
# Everything the GPU machine's image lacks, in one folder to carry: `.whl/` (in .gitignore).
#
#   bash infire_jax/bench/gpu_wheels.sh fetch     # here, with network: fills .whl/ (about 50 MB)
#   source infire_jax/bench/gpu_wheels.sh use     # there, in the repository root, before any bench
#
# The image (Python 3.12, jax 0.11 for CUDA 13) has no network and lacks
#   * gguf, llguidance, constriction: `import infire_jax` needs them; jsonschema (with its own
#     dependencies) in case the image lacks it: the server's tool-call parsers need it;
#   * mooncake-transfer-engine-non-cuda (the KV transfer of prefill/decode workers; the one
#     pyproject.toml names, TCP only, which is what workers sharing one GPU use) and the system
#     libraries its engine.so needs beyond glibc: libibverbs.so.1 (with libnl-3, libnl-route-3)
#     and libnuma.so.1, taken from this machine's Debian 12 packages (they need glibc 2.34). RDMA
#     providers (ibverbs-providers) are left out: TCP transfers never load one.
# `use` installs the wheels under /tmp/site, puts the libraries on LD_LIBRARY_PATH (fleet workers
# inherit both) and names any library engine.so still cannot find (libcurl.so.4 is expected on
# the image).

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir="$root/.whl"
wheels=(gguf==0.19.0 llguidance==1.9.1 constriction==0.5.0 mooncake-transfer-engine-non-cuda==0.3.13.post1
        jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0)
debs=(libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1)

fetch() (
    set -euo pipefail
    rm -rf "$dir" && mkdir -p "$dir/sys"
    "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dir" "${wheels[@]}"
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -q "${debs[@]}" >/dev/null 2>&1) || {
        echo "apt-get download failed: run apt-get update first" >&2; exit 1; }
    for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/x"; done
    # the sonames the loader looks for, as plain files (a carried folder may drop links)
    find "$tmp/x" -type l -name 'lib*.so.[0-9]*' -path '*x86_64-linux-gnu/lib*' -exec cp -L {} "$dir/sys/" \;
    rm -rf "$tmp"
    du -sh "$dir"
)

use() {
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$dir"/*.whl
    export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}"
    export LD_LIBRARY_PATH="$dir/sys${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local missing
    missing=$(ldd /tmp/site/mooncake/engine.so | grep 'not found' || true)
    if [ -n "$missing" ]; then echo "Mooncake's engine.so still lacks: $missing" >&2; fi
}

case "${1:-}" in
    fetch) fetch ;;
    use) use ;;
    *) echo "usage: bash ${BASH_SOURCE[0]} fetch | source ${BASH_SOURCE[0]} use" >&2; return 2 2>/dev/null || exit 2 ;;
esac
