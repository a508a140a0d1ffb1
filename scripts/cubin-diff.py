#!/usr/bin/env python3
"""Whether two revisions compile every kernel to the same machine code, without a GPU.

A change to kernel sources that only moves code (helpers, comments, names) is proven equivalent to
a revision that passed scripts/gpu-parity.sh when each kernel's .text section in the CUBIN is byte
for byte the same. Compiles each module as the engine does (common.cuh, mma.cuh where kernels.rs
prepends it, the module) for sm_90a with the NVRTC wheel of scripts/ci-nvrtc-check.sh.
  usage: LD_LIBRARY_PATH=<.venv-nvrtc nvidia/cu13/lib> scripts/cubin-diff.py OLD_REV NEW_REV module…
"""
import ctypes, glob, pathlib, re, struct, subprocess, sys
root = str(pathlib.Path(__file__).resolve().parent.parent)
lib=glob.glob(root+'/.venv-nvrtc/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13')[0]
nv=ctypes.CDLL(lib)
def show(rev, path):
    return subprocess.run(['git', '-C', root, 'show', f'{rev}:crates/calla-cuda/{path}'],
                          capture_output=True, text=True, check=True).stdout
def src(rev, name):
    # the modules that revision's kernels.rs prepends mma.cuh to
    mma = re.findall(r'(?:prefill|mma)_kernel_source!\("(\w+)"\)', show(rev, 'src/kernels.rs'))
    s = show(rev, 'kernels/common.cuh') + '\n'
    if name in mma: s += show(rev, 'kernels/mma.cuh') + '\n'
    if name == 'decode_layer':  # kernels.rs: the decode kernels' sources first, for their device functions
        s += '#define PHASES_ONLY\n' + ''.join(show(rev, f'kernels/{p}.cu') + '\n' for p in ('matvec', 'deltanet', 'moe'))
    return s + show(rev, f'kernels/{name}.cu')
def cubin(text,name):
    prog=ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog),text.encode(),(name+'.cu').encode(),0,None,None)==0
    opts=[b"--std=c++17",b"--fmad=true",b"-default-device",b"--extra-device-vectorization",b"--gpu-architecture=sm_90a"]
    arr=(ctypes.c_char_p*len(opts))(*opts)
    rc=nv.nvrtcCompileProgram(prog,len(opts),arr)
    if rc:
        n=ctypes.c_size_t(); nv.nvrtcGetProgramLogSize(prog,ctypes.byref(n)); b=ctypes.create_string_buffer(n.value); nv.nvrtcGetProgramLog(prog,b); sys.exit(b.value.decode())
    n=ctypes.c_size_t(); nv.nvrtcGetCUBINSize(prog,ctypes.byref(n)); b=ctypes.create_string_buffer(n.value); nv.nvrtcGetCUBIN(prog,b)
    return b.raw
def texts(elf):
    shoff,=struct.unpack_from('<Q',elf,0x28); shentsize,shnum,shstrndx=struct.unpack_from('<HHH',elf,0x3A)
    secs=[struct.unpack_from('<IIQQQQIIQQ',elf,shoff+i*shentsize) for i in range(shnum)]
    stro=secs[shstrndx][4]
    def nm(o): e=elf.index(b'\0',stro+o); return elf[stro+o:e].decode()
    return {nm(s[0]):elf[s[4]:s[4]+s[5]] for s in secs if nm(s[0]).startswith('.text.')}
old_rev,new_rev=sys.argv[1],sys.argv[2]
for name in sys.argv[3:]:
    a=texts(cubin(src(old_rev,name),name)); b=texts(cubin(src(new_rev,name),name))
    same=[k for k in a if k in b and a[k]==b[k]]; diff=[k for k in a if k in b and a[k]!=b[k]]
    print(f"{name}: {len(same)} kernels identical, {len(diff)} differ {diff[:6]}, only old {sorted(set(a)-set(b))[:6]}, only new {sorted(set(b)-set(a))[:6]}")
