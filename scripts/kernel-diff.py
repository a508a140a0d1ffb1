#!/usr/bin/env python3
"""Whether two revisions compile every shipped kernel to the same machine code, without a GPU.

A change to the kernel sources that only moves code (files, helpers, comments, names of other
kernels) is proven equivalent to a revision that passed scripts/gpu-parity.sh when each kernel's
.text and .nv.constant0 sections in the CUBIN are byte for byte the same and its static shared
memory has the same size (.nv.info is left out: its records name other sections by their index in
the module, which changes when kernels move between modules). Each module is
assembled as calla-cuda's runtime/kernels.rs does (common.cuh, then mma.cuh for the tensor-core
modules, then the family's .cu) and compiled for sm_90a with the options of runtime/nvrtc.rs, by
the NVRTC wheel that scripts/ci-nvrtc-check.sh installs into .venv-nvrtc. Kernels are matched by
name across modules, so a kernel may move from one .cu file to another.
  usage: scripts/kernel-diff.py OLD_REV NEW_REV      (e.g. scripts/kernel-diff.py main HEAD)
"""
import ctypes, glob, hashlib, os, pathlib, re, struct, subprocess, sys

root = str(pathlib.Path(__file__).resolve().parent.parent)
libs = glob.glob(root + "/.venv-nvrtc/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13")
if not libs:
    sys.exit("no NVRTC: run scripts/ci-nvrtc-check.sh first (it installs .venv-nvrtc)")
os.environ["LD_LIBRARY_PATH"] = os.path.dirname(libs[0])
ctypes.CDLL(os.path.dirname(libs[0]) + "/libnvrtc-builtins.so.13.0", mode=ctypes.RTLD_GLOBAL)
nv = ctypes.CDLL(libs[0])
OPTS = [b"--std=c++17", b"--fmad=true", b"-default-device", b"--extra-device-vectorization",
        b"--gpu-architecture=sm_90a"]


def show(rev, path):
    r = subprocess.run(["git", "-C", root, "show", f"{rev}:crates/calla-cuda/{path}"],
                       capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def modules(rev):
    """{module: source} as that revision's kernels.rs assembles them (old and new layouts)."""
    kr = show(rev, "src/runtime/kernels.rs") or show(rev, "src/kernels.rs")
    base = "src/ops/" if show(rev, "src/ops/common.cuh") is not None else "kernels/"
    common = show(rev, base + "common.cuh")
    for part in ("dot", "selection", "decode_params", "routing"):  # common.cuh's later parts, if split
        text = show(rev, f"{base}{part}.cuh")
        if text is not None:
            common += f'#line 1 "{part}.cuh"\n{text}'
    mma = show(rev, base + "mma.cuh")
    out = {}
    tc = show(rev, base + "matvec_tc.cuh")
    names = re.findall(r'(tc_kernel_source|mma_kernel_source|kernel_source)!\("(\w+)"\)', kr)
    if "kernel_source" not in [k for k, n in names if n == "select"] and 'name: "select"' in kr:
        names.append(("kernel_source", "select"))
    for kind, name in names:
        if name in ("lab_stream", "decode_layer", "grid_sync"):
            continue
        src = show(rev, base + name + ".cu") or show(rev, f"src/{name}.cu")
        if name == "select" and show(rev, base + "select_rules.cuh") is not None:
            src = "".join(f'#line 1 "{p}"\n' + show(rev, base + p)
                          for p in ("select_rules.cuh", "select_sampling.cuh", "select.cu"))
        if kind == "tc_kernel_source":
            body = f'#line 1 "mma.cuh"\n{mma}\n#line 1 "matvec_tc.cuh"\n{tc}\n#line 1 "{name}.cu"\n{src}'
        elif kind == "mma_kernel_source":
            body = f'#line 1 "mma.cuh"\n{mma}\n#line 1 "{name}.cu"\n{src}'
        else:
            body = src
        out[name] = f'{common}\n#line 1 "{name}.cu"\n{body}'
    if "fill" not in out and show(rev, "src/fill.cu") is not None:
        out["fill"] = f'{common}\n#line 1 "fill.cu"\n{show(rev, "src/fill.cu")}'
    return out


def cubin(text, name):
    prog = ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), (name + ".cu").encode(), 0, None, None) == 0
    arr = (ctypes.c_char_p * len(OPTS))(*OPTS)
    if nv.nvrtcCompileProgram(prog, len(OPTS), arr):
        n = ctypes.c_size_t(); nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        b = ctypes.create_string_buffer(n.value); nv.nvrtcGetProgramLog(prog, b)
        sys.exit(f"{name}: {b.value.decode()}")
    n = ctypes.c_size_t(); nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    b = ctypes.create_string_buffer(n.value); nv.nvrtcGetCUBIN(prog, b)
    return b.raw


def sections(elf):
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    def nm(o):
        return elf[stro + o:elf.index(b"\0", stro + o)].decode()
    out = {}
    for s in secs:
        name = nm(s[0])
        if name.startswith((".text.", ".nv.constant0.")):
            out[name] = hashlib.sha1(elf[s[4]:s[4] + s[5]]).hexdigest()
        elif name.startswith(".nv.shared."):  # no bits in the file: its size is the kernel's static shared memory
            out[name] = s[5]
    return out


def digests(rev):
    out = {}
    for name, text in modules(rev).items():
        out.update(sections(cubin(text, name)))
    return out


old, new = digests(sys.argv[1]), digests(sys.argv[2])
same = [k for k in old if k in new and old[k] == new[k]]
diff = sorted(k for k in old if k in new and old[k] != new[k])
gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
kernels = lambda ks: sorted({k.split(".")[-1] for k in ks})
print(f"{len(same)} sections identical; differ: {kernels(diff)}; only in {sys.argv[1]}: {kernels(gone)}; "
      f"only in {sys.argv[2]}: {kernels(added)}")
sys.exit(1 if diff else 0)
