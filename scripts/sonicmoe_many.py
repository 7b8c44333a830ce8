"""Runs SonicMoE's benchmark function (`run` of benchmarks/moe-cute.py, copied by
scripts/sonicmoe_compare.sh to .sonic/src/moe_cute_run.py) for several configs in one process, so
that its CuTe DSL kernels compile once per shape class and not once per config. Each config's
output goes to OUT/sonic_<name>.log as the script would print it alone. Not part of machmoe: a
comparison tool for the GPU machine.

Usage: python3 scripts/sonicmoe_many.py OUT NAME[,NAME...] [--check-first]
"""

import contextlib
import io
import os
import sys
import time

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(root, "python"))
sys.path.insert(0, os.path.join(root, ".sonic", "src"))

import cutlass  # noqa: E402
import torch  # noqa: E402

import moe_cute_run  # noqa: E402
from machmoe.bench.configs import CONFIGS_BY_NAME  # noqa: E402


class _Tee(io.TextIOBase):
    def __init__(self, *files):
        self.files = files

    def write(self, s):
        for f in self.files:
            f.write(s)
            f.flush()
        return len(s)


def main() -> int:
    out, names = sys.argv[1], sys.argv[2].split(",")
    check_first = "--check-first" in sys.argv[3:]
    # run() decorates two new closures with torch.compile per call; without a reset, dynamo's
    # recompile limit would silently leave later configs in eager mode.
    torch._dynamo.config.cache_size_limit = 64
    for i, name in enumerate(names):
        c = CONFIGS_BY_NAME[name]
        torch._dynamo.reset()
        t0 = time.time()
        with open(os.path.join(out, f"sonic_{name}.log"), "w") as log:
            tee = _Tee(sys.__stdout__, log)
            with contextlib.redirect_stdout(tee), contextlib.redirect_stderr(tee):
                try:
                    moe_cute_run.run((c.T, c.d, c.n, c.E, c.K), cutlass.BFloat16,
                                     skip_test=not (check_first and i == 0), add_bias=False,
                                     activation="swiglu")
                    print("rc 0")
                except Exception as err:  # noqa: BLE001 - recorded per config, the others go on
                    print(f"rc 1 {type(err).__name__}: {err}")
                print(f"wall {time.time() - t0:.0f} s")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
