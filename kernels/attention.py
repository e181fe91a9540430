"""Non-causal multi-head attention with grouped-query (GQA) key/value heads.

    o[b, h] = softmax(q[b, h] @ k[b, g]^T * scale) @ v[b, g],   g = h // (Hq // Hkv),  scale = D ** -0.5

q (B, Hq, N, D), k and v (B, Hkv, N, D) with Hq % Hkv == 0: key/value head g serves the query heads
g*r ... g*r + r - 1 (r = Hq / Hkv), the same grouping as torch.repeat_interleave(k, r, dim=1). No mask,
no dropout. The output has the shape of q; its memory layout may differ (an implementation may return a
(B, N, Hq, D)-contiguous tensor viewed as (B, Hq, N, D), so that merging the heads for the output
projection is free).
"""

import importlib

import torch
import torch.nn.functional as F

from . import dispatch


def query_heads_per_kv_head(q: torch.Tensor, k: torch.Tensor) -> int:
    """r = Hq / Hkv, the query heads each key/value head serves (an error unless Hkv divides Hq)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """The definition of attention, through PyTorch SDPA (its math is the formula in the module docstring).
    With enable_gqa, SDPA pairs query head h with key/value head h // r itself: the grouping of
    repeat_interleave, without materializing the repeated K and V (r times their memory). Checked against
    the explicit formula in tests/test_kernels.py. On CUDA a head dim that is not a multiple of 8 (5b: 76) goes
    through `sdpa_padded`, so that SDPA's flash and cuDNN backends can take it."""
    enable_gqa = query_heads_per_kv_head(q, k) > 1
    if q.is_cuda and q.shape[-1] % SDPA_HEAD_DIM_MULTIPLE:
        return sdpa_padded(q, k, v, scale, enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)


# SDPA's flash and cuDNN backends take head dims that are multiples of 8 only; any other falls to the efficient
# or the math backend, and math materializes an N x N matrix per head and image.
SDPA_HEAD_DIM_MULTIPLE = 8


def sdpa_padded(q, k, v, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA with q, k and v padded by zero columns to a head dim that is a multiple of 8 (76 -> 80), the true
    head dim's scale, and the padding sliced off the output. Exact: the zeros add nothing to q . k, and the extra
    output columns (weighted sums of v's zero columns) are dropped (tests/test_cuda_safety.py: bit for bit on
    CPU). The output is a view of a (B, Hq, N, 80) tensor."""
    D = q.shape[-1]
    pad = -D % SDPA_HEAD_DIM_MULTIPLE
    scale = D ** -0.5 if scale is None else scale
    q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))  # (B, H, N, D + pad), zeros in the last `pad` columns
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)[..., :D]


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The probabilities of the attention above, for looking at them: q (B, Hq, N, D), k (B, Hkv, N, D) ->
    p = softmax(q k^T * scale) (B, Hq, N, N), rows the queries, key head h // r serving query head h (K
    repeated per query head with repeat_interleave), the softmax in fp32 (or wider) and p rounded to q's
    dtype, as transformers' eager attention. It holds an N x N matrix per head and image, which `attention`
    never does: plain PyTorch, never dispatched, computed beside `attention` (not instead of it) for the
    blocks whose attention is inspected (Sapiens2.forward(attentions=...)), so that those blocks' outputs
    are the ones they give when nobody looks."""
    k = k.repeat_interleave(query_heads_per_kv_head(q, k), dim=1)  # (B, Hq, N, D)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16/fp16, fp64 stays fp64
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1, dtype=softmax_dtype).to(q.dtype)


def _attention_triton(q, k, v, scale):
    """The Triton implementation the choice in force names (dispatch.TRITON_ATTENTION_MODULE: attention_triton.py,
    or its Hopper variants under fastest), imported on first use so that `import kernels` never imports triton.
    Setting this hook to None means "reference only"."""
    name = dispatch.TRITON_ATTENTION_MODULE.get(dispatch.requested_backend(), "attention_triton")
    return importlib.import_module(f".{name}", __package__).attention_triton(q, k, v, scale)


def _race(q, k, v, scale):
    """(case key, run Triton, run the reference) on these inputs, for dispatch.faster: the forward alone
    for inference, forward + backward when the call will train. Nothing is allocated unless the case is
    timed (the runners build their inputs on first use; ones as the output gradient: no RNG is consumed)."""
    key = dispatch.case_key("attention", q, k, v)
    if key.endswith("|infer"):
        def timed(fn):
            def run():
                with torch.no_grad():
                    fn(q, k, v, scale)
            return run
    else:
        state = {}

        def training_inputs():
            if not state:
                state["leaves"] = [t.detach().requires_grad_() for t in (q, k, v)]
                state["grad_out"] = torch.ones_like(q)
            return state["leaves"], state["grad_out"]

        def timed(fn):
            def run():
                leaves, grad_out = training_inputs()
                torch.autograd.grad(fn(*leaves, scale), leaves, grad_out)
            return run
    return key, timed(_attention_triton), timed(attention_reference)


def _probe(q, k, v, scale):
    """The checked first launch of this call's family (dispatch.checked): a small case with its dtype and head
    dim (B = 1, Hq = 2, Hkv = 1, in (B, N, H, D) memory), on its device. N = 70 on CUDA (a full 64-row tile
    and a ragged one), 18 in the CPU interpreter (its tiles are 16 rows)."""
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    D, device = q.shape[-1], q.device
    family = dispatch.family_key("attention", dispatch.launch_device(q), (q.dtype,), D, training)
    N = 70 if q.is_cuda else 18

    def make_inputs():
        return (*(dispatch.bnhd(1, h, N, D, q.dtype, device, seed) for h, seed in ((2, 6), (1, 7), (1, 8))),
                scale)

    run_triton = dispatch.probe_runner(lambda *a: _attention_triton(*a), make_inputs, 3, training)
    run_reference = dispatch.probe_runner(attention_reference, make_inputs, 3, training)
    return family, run_triton, run_reference, dispatch.tolerance(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q (B, Hq, N, D), k/v (B, Hkv, N, D) -> o (B, Hq, N, D). On CUDA by default torch SDPA; Triton under
    SAPIENS2_KERNELS=triton, or =fastest where it was timed faster (see kernels/dispatch.py)."""
    return dispatch.run("attention", (q, k, v), _attention_triton and (lambda: _attention_triton(q, k, v, scale)),
                        lambda: attention_reference(q, k, v, scale), probe=lambda: _probe(q, k, v, scale),
                        race=lambda: _race(q, k, v, scale))
