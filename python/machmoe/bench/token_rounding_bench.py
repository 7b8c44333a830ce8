"""Layer forward with and without token rounding on the SPEC sparse config (T 16384, d 1536, n 1024,
E 128, K 2), FLOPs counted on the T*K routed rows (SPEC: count rows actually processed; with
rounding the processed rows differ by less than one tile per expert). python -m machmoe.bench.token_rounding_bench"""
import torch, machmoe
from machmoe import functional
from machmoe.bench.timing import cuda_time
T, d, n, E, K = 16384, 1536, 1024, 128, 2
x = [torch.randn(T, d, device="cuda").bfloat16() for _ in range(3)]
wr = (torch.randn(E, d, device="cuda") * 0.02).bfloat16()
w1 = (torch.randn(E, 2 * n, d, device="cuda") * 0.02).bfloat16()
w2 = (torch.randn(E, d, n, device="cuda") * 0.02).bfloat16()
def f(xx, mode):
    with torch.no_grad():
        return functional.moe(xx, wr, w1, w2, num_experts_per_tok=K, token_rounding=mode, tile_m=128)
for mode in ("none", "nr"):
    t = cuda_time(lambda xx: f(xx, mode), [(xx,) for xx in x]).median_ms
    print(f"machmoe forward T={T} d={d} n={n} E={E} K={K} token_rounding={mode}: {t:.3f} ms, "
          f"{6 * T * K * n * d / t / 1e9:.0f} TFLOPS (routed rows T*K)")
