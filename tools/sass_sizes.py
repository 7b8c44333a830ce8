#!/usr/bin/env python3
"""Bytes of SASS per kernel in a cubin (the ELF's .text.<kernel> sections), largest last, names
demangled by c++filt when it is there. Needs no GPU and no CUDA binary utilities:

    nvcc -I include -I src -O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr \\
         "--generate-code=arch=compute_90a,code=[sm_90a]" -x cu -cubin -o /tmp/gg.cubin src/host/gemm/grouped_gemm.cu
    python3 tools/sass_sizes.py /tmp/gg.cubin [substring]

Why: an epilogue unrolled over many sub-tiles (and over runtime choices such as the activation)
can outgrow the instruction caches: a dH kernel variant of 559 KB stalled on `no_instruction`
(Nsight Compute). Each SASS instruction is 16 bytes."""

import shutil
import struct
import subprocess
import sys


def text_sections(path: str) -> list[tuple[int, str]]:
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise SystemExit(f"{path}: not a 64-bit ELF (a cubin from nvcc -cubin)")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(off: int) -> str:
        end = data.index(b"\0", names_at + off)
        return data[names_at + off:end].decode()

    return sorted((h[5], name(h[0])[len(".text."):]) for h in headers if name(h[0]).startswith(".text."))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    rows = text_sections(argv[0])
    names = [n for _, n in rows]
    if shutil.which("c++filt"):
        names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    pattern = argv[1] if len(argv) > 1 else ""
    for (size, _), n in zip(rows, names):
        if pattern in n:
            print(f"{size:8d}  {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
