"""Fused kernels of the Sapiens2 backbone, each beside the plain PyTorch reference that defines it.

    qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)  per-head RMSNorm of q and k, then 2-D RoPE
    attention(q, k, v, scale)                               non-causal GQA attention
    attention_probs(q, k, scale)                            its probabilities softmax(q k^T * scale), written out
                                                            (plain PyTorch only: for inspecting attention maps)

Each public function dispatches between its reference (`*_reference`, the definition, used on CPU) and a
Triton implementation (on CUDA, when one exists and triton imports; kernels/*_triton.py, imported on first
use only). `SAPIENS2_KERNELS=auto|fastest|torch|triton` sets the choice for the process, `backend(choice)` for the calls
inside it. See kernels/README.md.

NOTE: keep this file import-light and side-effect free, and never define `__version__` here.
transformers probes for the Hugging Face hub package that is also called `kernels`; when it finds no
package metadata it imports whatever `kernels` is first on sys.path and reads its `__version__`. Without
one, transformers concludes that this is not the hub package (see tests/test_kernels_name_clash.py).
"""

if __name__ == "kernels":  # a bare `import kernels` in a checkout gives the one package, sapiens2.kernels
    __import__("sapiens2").one_module(__name__)
else:
    from .dispatch import backend
    from .attention import attention, attention_probs, attention_reference
    from .qk_norm_rope import qk_norm_rope, qk_norm_rope_reference, rms_norm_reference, rope_reference

__all__ = [
    "attention",
    "attention_probs",
    "attention_reference",
    "backend",
    "qk_norm_rope",
    "qk_norm_rope_reference",
    "rms_norm_reference",
    "rope_reference",
]
