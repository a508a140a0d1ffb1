# Sourced by the gpu-*.sh scripts: where the binaries are, where outputs go, which kernel cache.
#   BIN_DIR  the binaries of scripts/gpu-build.sh (default .gpu-bin)
#   OUT_DIR  logs and reports (default ./out)
#   CALLA_KERNEL_CACHE  kernel cache; default $BIN_DIR/kernel-cache (the CUBINs gpu-build.sh
#            compiled, so the GPU machine does not spend its time in NVRTC), copied to a temporary
#            folder first when that one is not writable.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN_DIR=${BIN_DIR:-.gpu-bin}
OUT_DIR=${OUT_DIR:-$PWD/out}
mkdir -p "$OUT_DIR"
export BIN_DIR OUT_DIR
if [ ! -x "$BIN_DIR/calla" ]; then
    echo "no $BIN_DIR/calla: run scripts/gpu-build.sh first (or set BIN_DIR)" >&2
    exit 2
fi
if [ -z "${CALLA_KERNEL_CACHE:-}" ] && [ -d "$BIN_DIR/kernel-cache" ]; then
    if [ -w "$BIN_DIR/kernel-cache" ]; then
        export CALLA_KERNEL_CACHE=$PWD/$BIN_DIR/kernel-cache
    else
        export CALLA_KERNEL_CACHE=${TMPDIR:-/tmp}/calla-kernels
        mkdir -p "$CALLA_KERNEL_CACHE" && cp -r "$BIN_DIR/kernel-cache/." "$CALLA_KERNEL_CACHE/"
    fi
fi
export CALLA_FIXTURES=${CALLA_FIXTURES:-$PWD/tests/fixtures}
echo "binaries of $(tr '\n' ' ' < "$BIN_DIR/COMMIT" 2>/dev/null || echo '(unknown commit)')"
