"""Pieces the GPU test files share: the activation table of the float64 references, the GLU
names, the relative error per tensor, expert offsets from row counts, the op namespace,
random layer tensors."""

import torch
import torch.nn.functional as F

from machmoe import _ops, torch_backend

# act(gate) for the GLU kinds, act(h) for the others (the kernels' tanh-form GELU).
ACTS = {
    "swiglu": F.silu, "geglu": lambda g: F.gelu(g, approximate="tanh"), "reglu": F.relu,
    "relu2": lambda h: F.relu(h) ** 2, "relu": F.relu, "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}
GLU = ("swiglu", "geglu", "reglu")


def ops():
    _ops.require_ops()
    return torch.ops.machmoe


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def offsets(counts):
    """expert_offsets [E+1] int32 on the GPU for per-expert row counts."""
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def make_layer(T, d, n, E, act, bias, std=0.02):
    """Random bf16 layer tensors on the GPU: x, router_weight, w1 [E, n1, d], w2 [E, d, n], biases."""
    n1 = 2 * n if act in GLU else n
    dev = "cuda"
    return {
        "x": torch.randn(T, d, device=dev).bfloat16(),
        "router_weight": (torch.randn(E, d, device=dev) * std).bfloat16(),
        "w1": (torch.randn(E, n1, d, device=dev) * std).bfloat16(),
        "w2": (torch.randn(E, d, n, device=dev) * std).bfloat16(),
        "b1": (torch.randn(E, n1, device=dev) * 0.1).bfloat16() if bias else None,
        "b2": (torch.randn(E, d, device=dev) * 0.1).bfloat16() if bias else None,
    }


def redraw_near_ties(t, K, routing="softmax_topk", selection_bias=None, max_rounds=50):
    """Redraws (in place) the rows of t["x"] whose float64 top-K choice is within the GPU router's
    rounding of a different choice, so that the layer tests compare kernels, not tie-breaking.

    machmoe's router logits come from a bf16 tensor-core GEMM with fp32 output: measured |error| up
    to 7e-6 on the 7B-a shape (1.5e-6 relative; an fp32 CUDA-core GEMM: 6e-7). A token whose K-th and
    (K+1)-th selection keys differ by less than that may legitimately go to another K-th expert than
    the float64 reference's, and one such row counts as a large error in the per-tensor comparison
    (MACHMOE_TEST_SEED=1552588134: one 7B-a token with a gap of 3.2e-7 took the output's error from
    3.9e-3 to 1.1e-2). Near-tie selection is the routing tests' subject (test_gpu_routing.py).
    The window, 2^-16·‖x_t‖·max_e‖w_e‖ on the logit scale (Cauchy-Schwarz bounds |logit| by
    ‖x_t‖‖w_e‖), is ~65x the measured error; it redraws about 1% of the 7B-a tokens. Sigmoid keys
    σ(l) + bias move at most a quarter as much as the logits, so the same window covers them."""
    x = t["x"]
    T, d = x.shape
    if T == 0 or K >= t["router_weight"].shape[0]:
        return t
    wr = t["router_weight"].double()
    scale = 2 ** -16 * wr.norm(dim=1).max()
    for _ in range(max_rounds):
        logits = torch_backend.router_logits(x.double(), wr)  # [T, E] float64
        keys = logits
        if routing == "sigmoid":
            keys = torch.sigmoid(logits) + (0 if selection_bias is None else selection_bias.double())
        top = keys.topk(K + 1, dim=1).values  # [T, K+1] descending
        near = (top[:, K - 1] - top[:, K]) < scale * x.double().norm(dim=1)
        if not near.any():
            return t
        x[near] = torch.randn(int(near.sum()), d, device=x.device).to(x.dtype)
    raise AssertionError(f"redraw_near_ties: tokens still within the tie window after {max_rounds} redraws")


def _capture_step(layer, x, g):
    """A layer's forward + backward (out and the gradients of x and of every parameter, for output
    gradient g) run eagerly, again with host syncs forbidden (sync debug mode "error"), then
    captured in a CUDA graph -> (side stream, step, params, eager results, graph, captured outputs).

    Everything runs on a side stream, as torch's recipe for capturing a backward asks: autograd
    keeps the stream a leaf's gradient was first produced on, and a warm-up on the legacy default
    stream makes the captured backward wait on it (an invalidated capture). `layer` is a callable
    made on that stream (layer() -> the module), so that its first allocations happen there too."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        module = layer()
        params = list(module.parameters())
        x_static, g_static = x.clone().requires_grad_(True), g.bfloat16()

        def step():
            out, _ = module(x_static)
            return [out] + list(torch.autograd.grad([out], [x_static] + params, [g_static]))

        eager = step()
        side.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = step()
    return side, step, params, eager, graph, captured


def _poisoned_replay(graph, captured):
    for t in captured:
        t.fill_(float("nan"))  # poisoned: the replay must write every element
    graph.replay()


def eager_and_graph_replay(layer, x, g):
    """_capture_step's eager results and its graph's outputs after one replay (outputs poisoned with
    NaN before it) -> (eager, replayed) lists, for the caller to compare bitwise."""
    side, _, _, eager, graph, captured = _capture_step(layer, x, g)
    with torch.cuda.stream(side):
        _poisoned_replay(graph, captured)
    torch.cuda.synchronize()
    return eager, captured


def check_graph_replays_follow_the_parameters(layer, x, g, change, rounds=2):
    """_capture_step's graph replayed `rounds` times, `change(params)` writing the parameters in
    place between replays (as an optimizer step does): each replay (outputs poisoned before it)
    must equal bitwise an eager step on the parameters as they are then."""
    side, step, params, _, graph, captured = _capture_step(layer, x, g)
    with torch.cuda.stream(side):
        for replay in range(rounds):
            if replay:
                with torch.no_grad():
                    change(params)
            _poisoned_replay(graph, captured)
            want = step()
            side.synchronize()
            for i, (got, ref) in enumerate(zip(captured, want)):
                assert torch.equal(got, ref), f"replay {replay}: output {i} differs from the eager call"
    torch.cuda.synchronize()

