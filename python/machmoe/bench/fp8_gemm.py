"""The FP8 grouped GEMM beside the bf16 grouped GEMMs, at benchmark configs' expert shapes (GPU only):

    python -m machmoe.bench.fp8_gemm [--configs 7B-a,30B-b,120B-b] [--out DIR]

For each config (T, d, n, E, K; machmoe.bench.configs) the two forward expert GEMMs: the
up-projection (N = 2n, K = d) on the R = T·K rows of a random top-K routing (K distinct experts
per token, machmoe's routing metadata: expert_offsets and the row -> token map row_token [R]), and
the down-projection (N = d, K = n) on R rows spread uniformly over the E experts (what balanced
top-K routing gives). Each row of the table times, on the same shape:

* machmoe fp8:  torch.ops.machmoe.grouped_gemm_fp8 on pre-quantised operands (1x128 activation
                tiles, 128x128 weight blocks, DeepSeek-V3's recipe; quantisation not timed). On the
                up-projection rows it GATHERS: x [T, d] is quantised once, without a gather, and
                the GEMM reads row row_token[r] of it (gather=row_token), as the layer's forward
                would; on the down-projection rows A [R, n] is contiguous;
* machmoe bf16: torch.ops.machmoe.grouped_gemm with a plain store (the down-projection's kernel)
                on a contiguous A [R, K] (for the up rows: x[row_token] materialised, not timed);
* torch bf16:   torch._grouped_mm on the same contiguous A;
* torch fp8:    torch._scaled_grouped_mm with rowwise scales (one per row of A, one per output
                column of each expert's W) on the same contiguous A, "not available" where this
                PyTorch or GPU refuses it.
So on the up rows only the machmoe fp8 column pays for a gather (the table's heading says so).
A third row per config, "up + GLU", times the up-projection as the layers run it, both gathered:
machmoe fp8 with its GLU epilogue (torch.ops.machmoe.grouped_gemm_fp8_glu: H and A written in
E4M3 with their 1x128 scales) against machmoe bf16's GLU epilogue (H and A written in bf16);
torch has no such kernel ("-"). A fourth, "experts forward", times the experts' whole forward on
a random top-K routing: machmoe fp8 = machmoe.fp8_experts.experts_forward (x quantised, the FP8
up-projection with its GLU epilogue, the FP8 down-projection, the scored sum; the weights'
FP8 copies cached, as they are between optimizer steps) against machmoe bf16 = the experts_forward
op (the bf16 layer's experts) on the same list; TFLOPS count 6·T·K·n·d. A fifth, "layer fwd+bwd",
times the whole layer, forward and backward (torch.autograd.grad of out and the aux loss to x, the
router weight, w1 and w2), of machmoe.functional.moe on the kernels with precision="fp8" against
precision="bf16" on the same inputs (the FP8 weight copies cached, as between optimizer steps);
TFLOPS count 18·T·K·n·d, and each cell adds the call's peak memory above what was allocated before
it (inputs, weights and the FP8 copies: 3·E·n·d bytes per copy, plain and transposed).

TFLOPS = 2·R·N·K / time; times are medians of CUDA-event times over rotated argument sets after a
warm-up (machmoe.bench.timing.cuda_time). The "fp8 err" column is ‖C_fp8 − C_bf16‖ / ‖C_bf16‖ of
machmoe's two kernels on the same inputs (the gathered rows and their materialised copy give the
same product): a sanity check that the timed kernel computes the product, and on the up rows
that it reads the gathered rows (about 2^-5 for E4M3's 3 mantissa bits on random data; ~1.4 for
rows from the wrong tokens), not a test.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Optional

from .configs import select_configs

if TYPE_CHECKING:  # torch is imported late: --help answers without it
    import torch

IMPLS = ("machmoe fp8", "machmoe bf16", "torch bf16", "torch fp8")
SETS = 2  # rotated argument sets: the next call's inputs are not in L2
# Which columns gather A's rows (the rest run on a contiguous A [R, K]).
GATHER_NOTE = {"machmoe fp8": " (up rows: gathered)"}


def uniform_offsets(R: int, E: int, device) -> "torch.Tensor":
    """expert_offsets [E+1] int32: R rows over E experts, the first R mod E experts one more."""
    import torch

    counts = torch.full((E,), R // E, dtype=torch.int32)
    counts[: R % E] += 1
    return torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()]).to(device)


def routing(T: int, E: int, K: int):
    """A random top-K routing of T tokens: (expert_offsets [E+1], row_token [R = T·K]) int32."""
    from .gemm_kernels import random_routing

    return random_routing(T, E, K)


def rowwise_fp8(x: "torch.Tensor"):
    """x [..., K] bf16 -> (codes [..., K] float8_e4m3fn, scales [...] float32): one scale per row,
    amax / 448, saturated (torch's cast does not saturate)."""
    import torch

    xf = x.float()
    s = xf.abs().amax(-1).clamp_min(1e-12) / 448.0
    return (xf / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def make_set(R: int, N: int, K: int, E: int, offs, ops, row_token=None, T: int = 0):
    """One argument set: A [R, K] and W [E, N, K] in bf16, block-quantised (machmoe's ops) and
    rowwise-quantised (torch's layout: W as [E, K, N] column-major). With row_token [R] (the up
    rows): x [T, K] bf16, A = x[row_token] materialised for the contiguous columns, and machmoe
    fp8's operand x quantised without a gather (a_q [T, K], a_s [T, KB]), gathered in the GEMM."""
    import torch

    if row_token is None:
        a = torch.randn(R, K, device="cuda").bfloat16()
        a_q, a_s = ops.fp8_quantize_rows(a, None)
    else:
        x = torch.randn(T, K, device="cuda").bfloat16()
        a = x[row_token.long()].contiguous()
        a_q, a_s = ops.fp8_quantize_rows(x, None)
    w = (torch.randn(E, N, K, device="cuda") * 0.02).bfloat16()
    w_q, w_s, _, _ = ops.fp8_quantize_weights(w, False)
    a_rw, a_rs = rowwise_fp8(a)
    w_rw, w_rs = rowwise_fp8(w)  # scales [E, N]
    return dict(x=None if row_token is None else x, a=a, w=w, w_kn=w.transpose(1, 2), a_q=a_q, a_s=a_s, w_q=w_q, w_s=w_s, a_rw=a_rw, a_rs=a_rs,
                w_rw_kn=w_rw.transpose(1, 2), w_rs=w_rs, offs=offs, ends=offs[1:].contiguous(), R=R,
                gather=row_token)


def impl_fn(name: str, ops, max_ctas: int, glu: bool = False):
    """The timed call of column `name` (None: the column has no such kernel); glu: the up-projection
    with the layers' GLU epilogue, gathered in both machmoe columns."""
    import torch

    if glu:
        if name == "machmoe fp8":
            return lambda s: ops.grouped_gemm_fp8_glu(s["a_q"], s["a_s"], s["w_q"], s["w_s"], s["offs"], "swiglu", [],
                                                      None, max_ctas, s["gather"])
        if name == "machmoe bf16":
            return lambda s: ops.grouped_gemm(s["x"], s["gather"], s["offs"], s["w"], None, s["R"], "glu", "swiglu",
                                              "interleaved")
        return None
    if name == "machmoe fp8":
        return lambda s: ops.grouped_gemm_fp8(s["a_q"], s["a_s"], s["w_q"], s["w_s"], s["offs"], max_ctas,
                                              s["gather"])
    if name == "machmoe bf16":
        return lambda s: ops.grouped_gemm(s["a"], None, s["offs"], s["w"], None, s["R"], "store", "swiglu",
                                          "interleaved")[0]
    if name == "torch bf16":
        return lambda s: torch._grouped_mm(s["a"], s["w_kn"], offs=s["ends"])
    if name == "torch fp8":
        return lambda s: torch._scaled_grouped_mm(s["a_rw"], s["w_rw_kn"], s["a_rs"], s["w_rs"], offs=s["ends"],
                                                  out_dtype=torch.bfloat16)
    raise ValueError(name)


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_shape(label: str, R: int, N: int, K: int, E: int, offs, row_token, T: int, glu: bool, min_reps: int,
              max_ctas: int) -> dict:
    """One row of the table; row_token [R] (or None): machmoe fp8 gathers A's rows from x [T, K];
    glu: the "up + GLU" row (impl_fn)."""
    import torch

    from machmoe import _ops

    from .timing import cuda_time

    _ops.require_ops()
    ops = torch.ops.machmoe
    sets = [(make_set(R, N, K, E, offs, ops, row_token, T),) for _ in range(SETS)]
    flops = 2.0 * R * N * K
    row = {"shape": label, "R": R, "N": N, "K": K, "E": E, "fp8_gathers": row_token is not None}
    outs = {}
    for name in IMPLS:
        fn = impl_fn(name, ops, max_ctas, glu)
        if fn is None:
            continue
        try:
            outs[name] = fn(*sets[0])
            torch.cuda.synchronize()
        except Exception as err:  # an op this PyTorch or GPU does not have: reported, not fatal
            row[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
            continue
        t = cuda_time(fn, sets, min_reps=min_reps).median_ms
        row[name] = {"ms": t, "tflops": flops / t / 1e9}
    if "machmoe fp8" in outs and "machmoe bf16" in outs and not glu:
        row["fp8_rel_err"] = rel_err(outs["machmoe fp8"], outs["machmoe bf16"])
    del sets, outs
    torch.cuda.empty_cache()
    return row


def run_forward(cfg, min_reps: int) -> dict:
    """The "experts forward" row of config cfg (module docstring)."""
    import torch

    from machmoe import _ops
    from machmoe.fp8_experts import experts_forward

    from .timing import cuda_time

    _ops.require_ops()
    ops = torch.ops.machmoe
    T, d, n, E, K = cfg.T, cfg.d, cfg.n, cfg.E, cfg.K

    def one_set():
        experts = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.int()
        return dict(x=torch.randn(T, d, device="cuda").bfloat16(), experts=experts,
                    scores=torch.rand(T, K, device="cuda"), tok=torch.arange(T, device="cuda", dtype=torch.int32)
                    .repeat_interleave(K), exp=experts.reshape(-1).contiguous(),
                    w1=(torch.randn(E, 2 * n, d, device="cuda") * 0.02).bfloat16(),
                    w2=(torch.randn(E, d, n, device="cuda") * 0.02).bfloat16())

    sets = [(one_set(),) for _ in range(SETS)]
    fns = {"machmoe fp8": lambda s: experts_forward(s["x"], s["w1"], s["w2"], s["scores"], s["experts"])[0],
           "machmoe bf16": lambda s: ops.experts_forward(s["x"], s["w1"], None, s["w2"], None, s["scores"].reshape(-1),
                                                         s["tok"], s["exp"], "swiglu", "interleaved")[0]}
    flops = 6.0 * T * K * n * d
    row = {"shape": f"{cfg.name} experts forward", "R": T * K, "N": 2 * n, "K": d, "E": E, "fp8_gathers": True}
    outs = {}
    for name, fn in fns.items():
        outs[name] = fn(*sets[0])
        t = cuda_time(fn, sets, min_reps=min_reps).median_ms
        row[name] = {"ms": t, "tflops": flops / t / 1e9}
    row["fp8_rel_err"] = rel_err(outs["machmoe fp8"], outs["machmoe bf16"])
    del sets, outs
    torch.cuda.empty_cache()
    return row


def run_layer(cfg, min_reps: int) -> dict:
    """The "layer fwd+bwd" row of config cfg (module docstring)."""
    import torch

    from machmoe import _ops, functional
    from machmoe.fp8_layer import new_cache

    from .timing import cuda_time

    _ops.require_ops()
    T, d, n, E, K = cfg.T, cfg.d, cfg.n, cfg.E, cfg.K
    cache = new_cache()

    def one_set():
        def leaf(*shape, std):
            return (torch.randn(*shape, device="cuda") * std).bfloat16().requires_grad_()

        return dict(x=leaf(T, d, std=1.0), wr=leaf(E, d, std=0.02), w1=leaf(E, 2 * n, d, std=0.02),
                    w2=leaf(E, d, n, std=0.02), dout=torch.randn(T, d, device="cuda").bfloat16())

    def fwd_bwd(precision: str):
        def call(s):
            out, aux = functional.moe(s["x"], s["wr"], s["w1"], s["w2"], num_experts_per_tok=K, backend="machmoe",
                                      precision=precision, fp8_cache=cache if precision == "fp8" else None)
            grads = torch.autograd.grad((out, aux), (s["x"], s["wr"], s["w1"], s["w2"]), (s["dout"], torch.ones_like(aux)))
            return out.detach(), grads

        return call

    sets = [(one_set(),) for _ in range(SETS)]
    fns = {"machmoe fp8": fwd_bwd("fp8"), "machmoe bf16": fwd_bwd("bf16")}
    flops = 18.0 * T * K * n * d
    row = {"shape": f"{cfg.name} layer fwd+bwd", "R": T * K, "N": 2 * n, "K": d, "E": E, "fp8_gathers": True}
    outs = {}
    for name, fn in fns.items():
        outs[name] = fn(*sets[0])[0]
        t = cuda_time(fn, sets, min_reps=min_reps).median_ms
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*sets[0])
        torch.cuda.synchronize()
        row[name] = {"ms": t, "tflops": flops / t / 1e9, "peak_gib": (torch.cuda.max_memory_allocated() - before) / 2**30}
    row["fp8_rel_err"] = rel_err(outs["machmoe fp8"], outs["machmoe bf16"])
    del sets, outs
    cache.invalidate()  # the FP8 copies freed before the next config
    torch.cuda.empty_cache()
    return row


def config_shapes(cfg) -> list:
    """(label, R, N, K, E, offs, row_token, T, glu): the config's up-projection on a random top-K
    routing (its expert_offsets for every column; machmoe fp8 gathered by its row_token), the same
    with the GLU epilogue, and its down-projection on R rows spread uniformly over the E experts
    (no gather)."""
    offs, row_token = routing(cfg.T, cfg.E, cfg.K)
    R = cfg.T * cfg.K
    up = (R, 2 * cfg.n, cfg.d, cfg.E, offs, row_token, cfg.T)
    return [(f"{cfg.name} up (N=2n, K=d)", *up, False), (f"{cfg.name} up + GLU", *up, True),
            (f"{cfg.name} down (N=d, K=n)", R, cfg.d, cfg.n, cfg.E, uniform_offsets(R, cfg.E, "cuda"), None,
             cfg.T, False)]


def _cell(v) -> str:
    if v is None:
        return "-"
    if "error" in v:
        return "not available"
    peak = f", peak {v['peak_gib']:.2f} GiB" if "peak_gib" in v else ""
    return f"{v['tflops']:.0f} ({v['ms']:.3f} ms{peak})"


def table(rows: list) -> str:
    # Only machmoe fp8 gathers, and only on the up rows: the heading says so.
    head = ("| shape | R x N x K, E | " + " | ".join(f"{n} TFLOPS" + GATHER_NOTE.get(n, "") for n in IMPLS)
            + " | fp8 err |")
    lines = [head, "|" + "---|" * (len(IMPLS) + 3)]
    for r in rows:
        err = f"{r['fp8_rel_err']:.1e}" if "fp8_rel_err" in r else "-"
        lines.append(f"| {r['shape']} | {r['R']} x {r['N']} x {r['K']}, {r['E']} | "
                     + " | ".join(_cell(r.get(n)) for n in IMPLS) + f" | {err} |")
    notes = sorted({f"{n}: {r[n]['error']}" for r in rows for n in IMPLS if isinstance(r.get(n), dict)
                    and "error" in r[n]})
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m machmoe.bench.fp8_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="7B-a,30B-b,120B-b", help="comma-separated config names")
    p.add_argument("--out", default=None, metavar="DIR", help="write fp8_gemm.md and fp8_gemm.json there")
    p.add_argument("--min-reps", type=int, default=20)
    p.add_argument("--max-ctas", type=int, default=0, help="grouped_gemm_fp8's max_ctas (0: one per SM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default="gemm,forward,layer",
                   help="which rows per config: gemm (up, up + GLU, down), forward (experts forward), layer "
                        "(layer fwd+bwd); the large configs' GEMM rows need ~120 GiB for their references")
    args = p.parse_args(argv)
    rows_wanted = set(args.rows.split(","))
    if not rows_wanted or rows_wanted - {"gemm", "forward", "layer"}:
        p.error(f"--rows takes a comma-separated subset of gemm,forward,layer; got {args.rows!r}")
    try:
        configs = select_configs(args.configs)
    except ValueError as err:
        p.error(str(err))

    import torch

    from machmoe import _ops

    why = _ops.kernels_unavailable_reason()
    if why is not None:
        print(f"machmoe.bench.fp8_gemm: nothing to measure: {why}")
        return 0
    torch.manual_seed(args.seed)
    from .timing import describe_protocol

    print(f"# FP8 grouped GEMM, {torch.cuda.get_device_name()}, torch {torch.__version__}; {describe_protocol()}")
    rows = []
    for cfg in configs:
        for shape in config_shapes(cfg) if "gemm" in rows_wanted else ():
            rows.append(run_shape(*shape, args.min_reps, args.max_ctas))
            print(table(rows[-1:]).splitlines()[2], flush=True)
        for name, run in (("forward", run_forward), ("layer", run_layer)):
            if name not in rows_wanted:
                continue
            rows.append(run(cfg, args.min_reps))
            print(table(rows[-1:]).splitlines()[2], flush=True)
    text = table(rows)
    print(text)
    if args.out:
        from .report import write_table

        write_table(args.out, "fp8_gemm", text, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
