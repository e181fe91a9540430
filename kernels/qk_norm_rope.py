"""Per-head RMSNorm of q and k followed by 2-D rotary position embedding (RoPE) of the patch tokens.

Math, for each head vector x of length D (q: (B, Hq, N, D), k: (B, Hkv, N, D)):

    x   = x * rsqrt(mean(x**2) + eps) * weight                 # RMSNorm over D, every token
    x_p = x_p * cos + rotate_half(x_p) * sin                   # the last P tokens only (the patches)
    rotate_half([x1 | x2]) = [-x2 | x1]                        # halves, not interleaved pairs

The first N - P tokens (CLS + registers) are normalized but not rotated. cos/sin are (P, D) tables laid
out as [y-freqs | x-freqs | y-freqs | x-freqs] (see sapiens2.RotaryEmbedding2D), so y-frequency j
rotates the pair of dims (j, j + D/2) and x-frequency j the pair (D/4 + j, 3D/4 + j). Worked example,
D = 8: dims (0, 4) and (1, 5) turn with the row coordinate, dims (2, 6) and (3, 7) with the column.

Precision. The rotation is computed in `cos.dtype`, and every token of q and k (prefix included) is
rounded to that dtype on the way in and back to the input dtype on the way out. That one rule gives both
RoPE conventions of the model:
  * original Sapiens2 (bf16 tables with an fp32 model): q/k round-trip through bf16 and the rotation
    rounds in bf16 after each op, exactly as the released weights were trained;
  * HF transformers (tables cast to the activation dtype): a no-op cast, the rotation in the model dtype.
The RMSNorm itself always computes in fp32 and rounds once (torch.nn.RMSNorm's behaviour).
"""

import torch
import torch.nn.functional as F

from . import dispatch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and rounded once to x.dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last P = cos.shape[0] tokens of x (..., N, D); see the module docstring for dtypes."""
    num_patches = cos.shape[0]
    num_prefix = x.shape[-2] - num_patches
    if num_prefix < 0:
        raise ValueError(f"RoPE table has {num_patches} positions but x has only {x.shape[-2]} tokens")
    # NOTE: the cast covers the prefix tokens too; the original rounds them to bf16 even though it never
    # rotates them, and parity with its outputs needs the same rounding.
    xr = x.to(cos.dtype)
    prefix, patches = xr.split((num_prefix, num_patches), dim=-2)  # (..., N-P, D), (..., P, D)
    patches = patches * cos + _rotate_half(patches) * sin
    return torch.cat((prefix, patches), dim=-2).to(x.dtype)


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """The definition of qk_norm_rope: RMSNorm of q and k per head, then RoPE of their patch tokens."""
    q = rope_reference(rms_norm_reference(q, q_weight, eps), cos, sin)
    k = rope_reference(rms_norm_reference(k, k_weight, eps), cos, sin)
    return q, k


def _qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps):
    """The Triton implementation (kernels/qk_norm_rope_triton.py), imported on first use so that
    `import kernels` never imports triton. Setting this hook to None means "reference only"."""
    from .qk_norm_rope_triton import qk_norm_rope_triton

    return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)


def _probe(q, k, q_weight, k_weight, cos, sin, eps):
    """The checked first launch of this call's family (dispatch.checked): a small case with its dtypes and head
    dim (B = 1, Hq = 2, Hkv = 1, 2 prefix tokens + 16 patches, in (B, N, H, D) memory), on its device."""
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_weight, k_weight))
    D, device = q.shape[-1], q.device
    family = dispatch.family_key("qk_norm_rope", dispatch.launch_device(q), (q.dtype, cos.dtype), D, training)

    def make_inputs():
        angles = dispatch.seeded((16, D), torch.float32, device, 3)
        return (dispatch.bnhd(1, 2, 18, D, q.dtype, device, 1), dispatch.bnhd(1, 1, 18, D, k.dtype, device, 2),
                1 + dispatch.seeded((D,), torch.float32, device, 4).to(q_weight.dtype) / 4,
                1 + dispatch.seeded((D,), torch.float32, device, 5).to(k_weight.dtype) / 4,
                angles.cos().to(cos.dtype), angles.sin().to(sin.dtype), eps)

    run_triton = dispatch.probe_runner(lambda *a: _qk_norm_rope_triton(*a), make_inputs, 4, training)
    run_reference = dispatch.probe_runner(qk_norm_rope_reference, make_inputs, 4, training)
    return family, run_triton, run_reference, dispatch.tolerance(q.dtype, cos.dtype)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """q (B, Hq, N, D), k (B, Hkv, N, D), weights (D,), cos/sin (P, D) -> normalized and rotated (q, k)."""
    # The kernel gives the RoPE tables no gradient (the model's tables are buffers): tables that learn take
    # the reference (auto) or are refused (SAPIENS2_KERNELS=triton).
    tables_learn = cos.requires_grad or sin.requires_grad
    unsupported = "gives cos/sin no gradient, and they require one" if tables_learn else None
    args = (q, k, q_weight, k_weight, cos, sin, eps)
    return dispatch.run("qk_norm_rope", (q, k), _qk_norm_rope_triton and (lambda: _qk_norm_rope_triton(*args)),
                        lambda: qk_norm_rope_reference(*args), probe=lambda: _probe(*args), unsupported=unsupported)
