#!/usr/bin/env bash
# The test command (README): Rust unit + integration tests of every crate, every CUDA kernel compiled
# by NVRTC for sm_90a (no GPU needed), and the OpenAI-client tests against a running `calla serve`.
# Installs its Python tools into .venv-test on first use (PyPI only).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-test
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r tests/python/requirements.txt

cargo build --release -p calla-cli
cargo test --workspace --release 2>&1
scripts/ci-nvrtc-check.sh "$venv"
CALLA_BIN="${CARGO_TARGET_DIR:-$PWD/target}/release/calla" "$venv/bin/python" -m pytest -q tests/python
