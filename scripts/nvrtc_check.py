"""Compile the CUDA C++ kernels of kernels/cuda/ with NVRTC, no GPU needed: every
instantiation the plans can launch, with the options build.py gives NVRTC, for one
architecture (default sm_90). A compile error fails the run and prints NVRTC's log.

    pip download --no-deps nvidia-cuda-nvrtc && unzip -o nvidia_cuda_nvrtc-*.whl -d /tmp/nvrtc
    python scripts/nvrtc_check.py --nvrtc /tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13
    python scripts/nvrtc_check.py --names 'pq_attn<128, 2, false, 12, 4, true, false, false>'

Default: every pq_attn build (each GQA grouping and codebook staging, the window,
soft-cap and multi-token flags; d 256: pq_attn_split) and pq_merge, for d 64, 128 and 256 at 12 warps (--warps 8 12 16: the bench's
sweep too). For another checkout's sources (--src-dir), name its instantiations with
--names as that checkout spells them.

--loop-stats prints, per instantiation, the instructions of its PQ tile loop (the
innermost loop with HMMAs and cp.async copies, from `nvdisasm -c` of the cubin; --nvdisasm
PATH, default: on PATH or Triton's copy), its registers and spills, and its most frequent
opcodes: docs/kernels.md's instruction counts.

--hashes FILE writes, per instantiation, the sha256 of its kernel's machine code (the
.text section of the cubin): two sources that give an instantiation the same hash
compile it to the same instructions (how a change that adds a template flag shows that
the builds without it are untouched).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from kvstore.kernels.cuda import attention, build
from kvstore.kernels.cuda.images import group


def find_nvrtc(path: str | None) -> str:
    if path:
        return path
    pats = [os.path.join(p, "nvidia", "cu13", "lib", "libnvrtc.so.*") for p in sys.path if p]
    pats += [os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*") for p in sys.path if p]
    for pat in pats:
        hits = sorted(h for h in glob.glob(pat) if "builtins" not in h)
        if hits:
            return hits[0]
    raise SystemExit("libnvrtc not found: pass --nvrtc PATH (pip download nvidia-cuda-nvrtc, unzip)")


class NVRTC:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _ok(self, rc, what):
        if rc:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, src: str, names: list[str], options: list[str]) -> tuple[bool, str, bytes, dict]:
        """-> (ok, log, cubin, {name: lowered name})."""
        prog = ctypes.c_void_p()
        self._ok(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernel.cu", 0, None, None),
                 "nvrtcCreateProgram")
        try:
            for n in names:
                self._ok(self.lib.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if rc:
                return False, log, b"", {}
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self._ok(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            lowered = {}
            for n in names:
                p = ctypes.c_char_p()
                self._ok(self.lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(p)), "nvrtcGetLoweredName")
                lowered[n] = p.value.decode()
            return True, log, cubin.raw, lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def text_sections(elf: bytes) -> dict[str, bytes]:
    """{symbol: bytes} of the .text.<symbol> sections of a 64-bit little-endian ELF."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx]
    names = elf[strtab[4]:strtab[4] + strtab[5]]
    out = {}
    for h in heads:
        name = names[h[0]:names.index(b"\0", h[0])].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = elf[h[4]:h[4] + h[5]]
    return out


def attention_names(warps, dims, features) -> list[str]:
    """Every pq_attn instantiation CudaPQPlan can launch for these warp counts (features:
    (window, softcap, multi-token) flags; a multi-token plan has no window)."""
    names = []
    for d, dsub, bf16, nw, (win, cap, mq) in itertools.product(dims, (2, 4), (False, True), warps, features):
        for gp in sorted({group(g, dsub) for g in range(1, 9)}):     # d 256: the split build
            for tma in (False, True):
                for step in ((1, 2) if dsub == 4 else (1,)):     # tunables.TILES_PER_STEP_2BIT
                    names.append(attention._attn_name(d, dsub, bf16, nw, gp, tma, win, cap, step, mq))
    return names


def find_nvdisasm(path: str | None) -> str:
    if path:
        return path
    hit = shutil.which("nvdisasm")
    if hit:
        return hit
    for p in sys.path:
        cand = os.path.join(p, "triton", "backends", "nvidia", "bin", "nvdisasm")
        if p and os.path.isfile(cand):
            return cand
    raise SystemExit("nvdisasm not found: pass --nvdisasm PATH")


def tile_loop(sass: str) -> list[str]:
    """The instructions of the innermost backward-branch loop of `sass` (one kernel's
    nvdisasm -c text) that holds HMMAs and cp.async copies (LDGSTS)."""
    ins, label_at, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*\.?(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                label_at[lab] = addr
            pending = []
            ins.append((addr, m.group(2).strip()))
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA.*?(L_x_\d+)", text)
        if m and label_at.get(m.group(1), addr) < addr:
            body = [t for a, t in ins if label_at[m.group(1)] <= a <= addr]
            if any("HMMA" in t for t in body) and any("LDGSTS" in t for t in body):
                loops.append(body)
    return min(loops, key=len) if loops else []


def loop_stats(nvdisasm: str, cubin: bytes, names: list[str], lowered: dict, log: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    # one kernel's code: from its section header to the next one
    parts = re.split(r"^//-+ \.text\.(\S+) -+$", text, flags=re.M)
    sass_of = dict(zip(parts[1::2], parts[2::2]))
    for n in names:
        body = tile_loop(sass_of.get(lowered[n], ""))
        ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0]
                                  for t in body)
        # ptxas -v reports each kernel after its "Compiling entry function '<name>'" line
        at = log.find(f"'{lowered[n]}'")
        regs = re.search(r"Used (\d+) registers", log[at:]) if at >= 0 else None
        spill = re.search(r"(\d+) bytes spill stores", log[at:]) if at >= 0 else None
        print(f"{n}: registers {regs.group(1) if regs else '?'}, spill stores "
              f"{spill.group(1) if spill else '?'} B; tile loop {len(body)} instructions: "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (default: a pip-installed nvidia-cuda-nvrtc)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--warps", type=int, nargs="+", default=[12])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--features", choices=["all", "none"], default="all",
                    help="pq_attn's (window, softcap, multi-token) flags: every build, or the plain one only")
    ap.add_argument("--source", default="attention.cu", help="kernel source of kernels/cuda/ (with --names)")
    ap.add_argument("--names", nargs="+", help="instantiations to compile (default: every pq_attn and pq_merge)")
    ap.add_argument("--src-dir", help="compile the sources of this folder instead (another checkout)")
    ap.add_argument("--batch", type=int, default=8, help="instantiations per NVRTC program")
    ap.add_argument("--hashes", help="write {instantiation: sha256 of its machine code} to this JSON file")
    ap.add_argument("--ptxas-verbose", action="store_true",
                    help="print ptxas's registers, spills and stack per kernel (NVRTC's log)")
    ap.add_argument("--loop-stats", action="store_true", help="print each build's tile-loop instructions")
    ap.add_argument("--nvdisasm", help="path of nvdisasm (with --loop-stats)")
    args = ap.parse_args()

    nv = NVRTC(find_nvrtc(args.nvrtc))
    if args.src_dir:
        build._DIR = os.path.abspath(args.src_dir)
    verbose = args.ptxas_verbose or args.loop_stats
    options = list(build.OPTIONS) + [f"-arch={args.arch}"] + (["--ptxas-options=-v"] if verbose else [])
    nvdisasm = find_nvdisasm(args.nvdisasm) if args.loop_stats else None
    feats = ([(w, c, m) for w, c, m in itertools.product((False, True), repeat=3) if not (w and m)]
             if args.features == "all" else [(False, False, False)])
    mqs = (False, True) if args.features == "all" else (False,)
    jobs = ([(args.source, args.names)] if args.names else
            [("attention.cu", attention_names(args.warps, args.dims, feats)),
             ("merge.cu", [attention._merge_name(d, bf, mq) for d in args.dims for bf in (False, True)
                           for mq in mqs])])
    hashes, failed, total = {}, 0, 0
    for src_name, names in jobs:
        src = build.source(src_name)
        for i in range(0, len(names), args.batch):
            chunk = names[i:i + args.batch]
            t0 = time.time()
            ok, log, cubin, lowered = nv.compile(src, chunk, options)
            total += len(chunk)
            if not ok:
                failed += len(chunk)
                print(f"FAIL {src_name}: {chunk}\n{log}")
                continue
            texts = text_sections(cubin)
            for n in chunk:
                hashes[n] = hashlib.sha256(texts[lowered[n]]).hexdigest()
            if nvdisasm and src_name == "attention.cu":
                loop_stats(nvdisasm, cubin, chunk, lowered, log)
                continue
            print(f"ok   {src_name} {len(chunk)} in {time.time() - t0:.1f} s: {chunk[0]} ... {chunk[-1]}"
                  + (f"\n{log}" if log.strip() else ""), flush=True)
    if args.hashes:
        with open(args.hashes, "w") as f:
            json.dump(hashes, f, indent=1, sort_keys=True)
    print(f"{total - failed} of {total} instantiations compiled for {args.arch}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
