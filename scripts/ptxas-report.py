#!/usr/bin/env python3
"""Registers, spills and shared memory of every kernel in one .cu file, without a GPU.

Compiles kernels/<name>.cu (prefixed with common.cuh, as the engine does) with the NVRTC wheel that
scripts/ci-nvrtc-check.sh installs, for sm_90a, with ptxas in verbose mode, and prints its report.
  usage: scripts/ptxas-report.py matvec [moe …]   (uses .venv-nvrtc)
  DEFS=A,B=1 adds defines; CUBIN_OUT=DIR also writes DIR/<name>.cubin (for nvdisasm -c).
"""
import ctypes, glob, os, pathlib, re, sys

root = pathlib.Path(__file__).resolve().parent.parent
lib = glob.glob(str(root / ".venv-nvrtc/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13"))
if not lib:
    sys.exit("run scripts/ci-nvrtc-check.sh once first (it installs the NVRTC wheel into .venv-nvrtc)")
nvrtc = ctypes.CDLL(lib[0])
kernels = root / "crates/calla-cuda/kernels"
common = (kernels / "common.cuh").read_text()
opts = [b"--std=c++17", b"--fmad=true", b"-default-device", b"--extra-device-vectorization", b"--gpu-architecture=sm_90a",
        b"--ptxas-options=-v"]
MMA_MODULES = {"matvec_tc", "attention", "gemm", "deltanet_prefill", "attention_prefill", "moe_prefill", "lab_stream"}
for name in sys.argv[1:]:
    # the tensor-core modules get kernels/mma.cuh first, as src/kernels.rs does
    mma = (kernels / "mma.cuh").read_text() + "\n" if name in MMA_MODULES else ""
    # the persistent layer gets the decode modules it is built from, as src/kernels.rs does
    parts = ["matvec", "deltanet", "moe", name] if name == "decode_layer" else [name]
    src = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in os.environ.get("DEFS", "").split(",") if d) + common + "\n" + mma + ("#define PHASES_ONLY\n" if len(parts) > 1 else "") + "\n".join((kernels / f"{p}.cu").read_text() for p in parts)
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        print(text)
        sys.exit(f"{name}.cu: compile failed")
    if os.environ.get("CUBIN_OUT"):  # the machine code too, for nvdisasm -c
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(prog, buf)
        (pathlib.Path(os.environ["CUBIN_OUT"]) / f"{name}.cubin").write_bytes(buf.raw)
    fn = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            spill = re.search(r"(\d+) bytes spill stores", text[text.find(fn):])
            print(f"{name}.cu  {fn:<32} {m.group(1):>4} registers  {line.strip()}")
        if "warning" in line.lower() or "Performance Loss" in line:
            print(f"{name}.cu  {fn or ''}  {line.strip()}")
        if "spill" in line and fn and not line.strip().startswith("0 bytes stack frame, 0 bytes spill"):
            print(f"{name}.cu  {fn:<32} {line.strip()}")
