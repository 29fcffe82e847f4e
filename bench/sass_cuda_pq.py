"""Instruction counts of pq_attn instantiations from their SASS (needs nvcc + cuobjdump).

python bench/sass_cuda_pq.py [--defs "-DX ..."] [--dump DIR] "128,2,false,12,4,true,true" ...
python bench/sass_cuda_pq.py --sass FILE ...      (parse SASS dumped earlier: no toolkit)
Each argument is a template argument list of pq_attn (D, DSUB, BF16, NW, GP, TMA, BS_POW2).
Per instantiation: registers, instructions in all, and in the PQ tile loop (the backward
branch whose body issues the ring's cp.async and holds the most shared-memory loads: one
tile per iteration) the count by opcode, and the integer-division markers in it (I2F(.U32).RP,
MUFU.RCP, IMAD.HI, IABS: the reciprocal sequence nvcc emits for a 32-bit `/` or `%`).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "cuda_pq.cu")
SIG = ("(const u16*, long long, long long, const int*, float*, float*, const u8*, const u8*, "
       "long long, long long, long long, long long, const u16*, const u16*, const int*, long long, "
       "const u16*, const u16*, long long, long long, long long, long long, long long, long long, "
       "const int*, long long, float, int, int, int, int, int, const u8*)")
INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass(targs: str, defs: list[str], tmp: str) -> tuple[str, str]:
    cu = os.path.join(tmp, "one.cu")
    with open(cu, "w") as f:
        f.write(f'#include "{os.path.abspath(SRC)}"\ntemplate __global__ void pq_attn<{targs}>{SIG};\n')
    cubin = os.path.join(tmp, "one.cubin")
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "--use_fast_math", "-cubin", "-o", cubin,
                        cu, "-Xptxas", "-v", *defs], capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    out = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return out, regs.group(1) if regs else "?"


def loop_stats(text: str):
    ins = [(int(a, 16), op.strip()) for a, op in INS.findall(text)]
    best = None
    for addr, op in ins:
        tgt = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if tgt is None or not op.startswith("@"):    # unconditional: jumps back from cold code
            continue
        t = int(tgt.group(1), 16)
        if t >= addr:
            continue
        body = [o for a, o in ins if t <= a <= addr]
        n_lds = sum(opcode(o).startswith("LDS") for o in body)
        ring = any(opcode(o).startswith("LDGSTS") for o in body)    # the CF loop's cp.async
        if best is None or (ring, n_lds) > best[0]:
            best = ((ring, n_lds), body)
    return ins, best


def opcode(o: str) -> str:
    o = re.sub(r"^@!?U?P\w+\s+", "", o)
    return o.split()[0] if o else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("targs", nargs="*")
    ap.add_argument("--sass", nargs="*", default=[])
    ap.add_argument("--defs", default="")
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    for path in args.sass:
        with open(path) as f:
            report(path, f.read(), "?", "")
    with tempfile.TemporaryDirectory() as tmp:
        for ta in args.targs:
            text, regs = sass(ta, args.defs.split(), tmp)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, "pq_attn_" + re.sub(r"\W", "_", ta) + ".sass"), "w") as f:
                    f.write(text)
            report(f"pq_attn<{ta}>", text, regs, args.defs)
    return 0


def report(name: str, text: str, regs: str, defs: str) -> None:
    ins, best = loop_stats(text)
    print(f"{name} {defs}: {regs} registers, {len(ins)} instructions")
    if best:
        c = collections.Counter(opcode(o) for o in best[1])
        print(f"  tile loop: {len(best[1])} instructions, {best[0][1]} LDS; "
              + ", ".join(f"{k} {v}" for k, v in c.most_common(30)))
        div = {k: v for k, v in c.items()
               if (k.startswith("I2F") and ".RP" in k) or k.startswith(("MUFU.RCP", "IMAD.HI", "IABS"))}
        print(f"  tile loop division markers: {sum(div.values())}: "
              + (", ".join(f"{k} {v}" for k, v in sorted(div.items())) or "(none)"))


if __name__ == "__main__":
    sys.exit(main())
