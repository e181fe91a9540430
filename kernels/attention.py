"""Non-causal multi-head attention with grouped-query (GQA) key/value heads.

    o[b, h] = softmax(q[b, h] @ k[b, g]^T * scale) @ v[b, g],   g = h // (Hq // Hkv),  scale = D ** -0.5

q (B, Hq, N, D), k and v (B, Hkv, N, D) with Hq % Hkv == 0: key/value head g serves the query heads
g*r ... g*r + r - 1 (r = Hq / Hkv), the same grouping as torch.repeat_interleave(k, r, dim=1). No mask,
no dropout. The output has the shape of q; its memory layout may differ (an implementation may return a
(B, N, Hq, D)-contiguous tensor viewed as (B, Hq, N, D), so that merging the heads for the output
projection is free).
"""

import torch
import torch.nn.functional as F

from .dispatch import case_key, use_triton


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
    the explicit formula in tests/test_kernels.py."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=query_heads_per_kv_head(q, k) > 1)


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
    """The Triton implementation (kernels/attention_triton.py), imported on first use so that
    `import kernels` never imports triton. Setting this hook to None means "reference only"."""
    from .attention_triton import attention_triton

    return attention_triton(q, k, v, scale)


def _race(q, k, v, scale):
    """(case key, run Triton, run the reference) on these inputs, for dispatch.faster: the forward alone
    for inference, forward + backward when the call will train. Nothing is allocated unless the case is
    timed (the runners build their inputs on first use; ones as the output gradient: no RNG is consumed)."""
    key = case_key("attention", q, k, v)
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q (B, Hq, N, D), k/v (B, Hkv, N, D) -> o (B, Hq, N, D). On CUDA by default the faster of Triton and
    SDPA for this case (timed once, see kernels/dispatch.py)."""
    if use_triton("attention", _attention_triton is not None, q, k, v, race=lambda: _race(q, k, v, scale)):
        return _attention_triton(q, k, v, scale)
    return attention_reference(q, k, v, scale)
