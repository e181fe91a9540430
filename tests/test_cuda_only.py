"""The kernels on a real GPU: CUDA only, skipped elsewhere (bench/gpu_session.sh runs this file first, with -v so
that its log names each test that passed, even if a later one faults the GPU).

In order of what a first GPU run must learn: the model on cuda:1 (when there is one) and the checked first launch
on this GPU; qk_norm_rope at the head dims of 0.4b, 0.8b and 5b (64, 80, 76); SDPA's flash backend on 5b's padded
head dim; then every configuration the autotuners may pick (kernels/attention_triton.py and its Hopper variants,
attention_triton_hopper.py: forward, dK/dV and dQ kernels, bf16 and fp32), forced one at a time, at those head
dims, forward and backward against the reference.

Tolerance (flash-attention's rule): the kernel's error against an fp32 (fp64 for fp32 inputs) reference may be at
most twice SDPA's error at the same input dtype, plus 2 machine epsilons of that dtype (SDPA's own error can be
near zero on a lucky input).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (the first GPU run)")

# (query heads, key/value heads, head dim) per preset, heads cut to 4 and 2 (GQA 2, as the presets' GQA blocks):
# the head dim is what changes the compiled kernel.
PRESETS = {"0.4b": (4, 2, 64), "0.8b": (4, 2, 80), "5b": (4, 2, 76)}
B, N = 2, 9 + 16 * 12  # CLS + 8 registers + 192 patches: ragged against every tile size


PLAIN_FORWARD = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}  # the backward tests' forward


def configurations():
    """(module, kernel name, fp32?, blocks dict) for every configuration the autotuners may pick (ids: the file, the
    kernel, the dtype, the label); none on CPU (the kernel modules must not be imported there before
    tests/test_kernels.py sets TRITON_INTERPRET)."""
    if not torch.cuda.is_available():
        return []
    from sapiens2.kernels import attention_triton, attention_triton_hopper
    from sapiens2.kernels.grid_triton import config_label

    found = []
    for file, module in (("base", attention_triton), ("hopper", attention_triton_hopper)):
        for (name, fp32), configs in module._CONFIGS.items():
            for c in configs:
                blocks = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages, "maxnreg": c.maxnreg}
                found.append(pytest.param(module, name, fp32, blocks, id=f"{file}-{name}-{'fp32' if fp32 else 'bf16'}-"
                                          f"{config_label(c.kwargs, c.num_warps, c.num_stages, c.maxnreg)}"))
    return found


def bnhd(H, D, dtype, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, H, D, generator=g).to(device=device, dtype=dtype).transpose(1, 2)


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def allowed(sdpa_err: float, dtype: torch.dtype) -> float:
    return 2 * sdpa_err + 2 * torch.finfo(dtype).eps


def reference_grads(q, k, v, do):
    """fp64 attention of the given inputs and its gradients (the truth both sides are measured against)."""
    from sapiens2.kernels import attention_reference

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o = attention_reference(*leaves)
    return (o, *torch.autograd.grad(o, leaves, do.double()))


def sdpa_grads(q, k, v, do):
    from sapiens2.kernels import attention_reference

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = attention_reference(*leaves)
    return (o, *torch.autograd.grad(o, leaves, do))


# ----------------------------------------------------------------------------------------------------
# The device, the checked first launch, qk_norm_rope, SDPA at D = 76
# ----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_model_on_the_second_gpu(monkeypatch):
    """A model on cuda:1 with cuda:0 current: every kernel launches on cuda:1 (forward and backward on Triton equal
    the reference's on the same GPU)."""
    from sapiens2 import Sapiens2, Sapiens2Config

    torch.manual_seed(0)
    model = Sapiens2(Sapiens2Config(embed_dim=152, depth=2, num_heads=2)).to("cuda:1")  # head dim 76
    x = torch.randn(1, 3, 64, 48, device="cuda:1")
    assert torch.cuda.current_device() == 0
    outs = {}
    for choice in ("triton", "torch"):
        monkeypatch.setenv("SAPIENS2_KERNELS", choice)
        model.zero_grad()
        tokens = model(x).tokens
        tokens.square().mean().backward()
        outs[choice] = (tokens.detach(), model.blocks[0].attn.wq.weight.grad.clone())
    for got, want in zip(outs["triton"], outs["torch"]):
        assert got.device == torch.device("cuda", 1)
        assert rel_err(got, want) < 1e-4  # fp32: the kernels agree with the references to ~1e-6 per op


def test_checked_first_launch_passes_on_this_gpu(monkeypatch):
    """On this GPU both ops pass their checked first launch, for inference and training, at every preset's
    head dim (a failure here names what the fallback would hide)."""
    from sapiens2 import kernels
    from sapiens2.kernels import dispatch

    monkeypatch.setenv("SAPIENS2_KERNELS", "triton")  # a failed check raises with its reason
    for hq, hkv, D in PRESETS.values():
        q, k, v = bnhd(hq, D, torch.bfloat16, 1), bnhd(hkv, D, torch.bfloat16, 2), bnhd(hkv, D, torch.bfloat16, 3)
        cos, sin = torch.ones(N - 9, D, device="cuda"), torch.zeros(N - 9, D, device="cuda")
        w = torch.ones(D, device="cuda")
        kernels.attention(q, k, v)
        kernels.qk_norm_rope(q, k, w, w, cos.bfloat16(), sin.bfloat16())
        kernels.attention(*(t.detach().requires_grad_() for t in (q, k, v)))
    results = dispatch.first_launch_results()
    assert results and all(problem is None for problem in results.values()), results


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_qk_norm_rope_at_each_preset(monkeypatch, preset, dtype):
    from sapiens2 import kernels
    from sapiens2.kernels import qk_norm_rope_reference

    monkeypatch.setenv("SAPIENS2_KERNELS", "triton")
    hq, hkv, D = PRESETS[preset]
    angles = torch.randn(N - 9, D, generator=torch.Generator().manual_seed(4)).cuda()
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()  # the original's bf16 tables
    leaves = [bnhd(hq, D, dtype, 5), bnhd(hkv, D, dtype, 6), torch.rand(D, device="cuda") + 0.5,
              torch.rand(D, device="cuda") + 0.5]
    leaves = [t.detach().requires_grad_() for t in leaves]
    got = kernels.qk_norm_rope(*leaves, cos, sin)
    got_grads = torch.autograd.grad(got, leaves, [torch.ones_like(t) for t in got])
    want = qk_norm_rope_reference(*leaves, cos, sin)
    want_grads = torch.autograd.grad(want, leaves, [torch.ones_like(t) for t in want])
    for g, w in zip((*got, *got_grads), (*want, *want_grads)):
        # bf16 tables: the kernel repeats the reference's roundings, so at most one bf16 rounding apart
        assert rel_err(g, w) <= 2 * torch.finfo(torch.bfloat16).eps


def test_sdpa_takes_head_dim_76_on_its_flash_backend():
    """5b's head dim padded to 80: SDPA runs with only the flash (and cuDNN) backends allowed, which refuse 76."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sapiens2.kernels import attention_reference

    q, k, v = bnhd(4, 76, torch.bfloat16, 7), bnhd(2, 76, torch.bfloat16, 8), bnhd(2, 76, torch.bfloat16, 9)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        o = attention_reference(q, k, v)
    want = reference_grads(q, k, v, torch.ones_like(q))[0]
    assert rel_err(o, want) < 4 * torch.finfo(torch.bfloat16).eps


# ----------------------------------------------------------------------------------------------------
# Every configuration the autotuner may pick, forced, at each preset's head dim
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("at,name,fp32,blocks", configurations())
def test_configuration_against_the_reference(preset, at, name, fp32, blocks):
    from sapiens2.kernels import attention_triton_hopper as hopper

    dtype = torch.float32 if fp32 else torch.bfloat16
    hq, hkv, D = PRESETS[preset]
    q, k, v = bnhd(hq, D, dtype, 10), bnhd(hkv, D, dtype, 11), bnhd(hkv, D, dtype, 12)
    do = bnhd(hq, D, dtype, 13)
    streamed = (k, v) if name != "dkdv" else (q, do)
    if blocks.get("TMA") and not hopper.tma_usable(*(hopper.aligned_heads(t) for t in streamed)):
        pytest.skip("TMA: not on this GPU (sm_90 only)")
    truth = reference_grads(q, k, v, do)
    sdpa = sdpa_grads(q, k, v, do)
    if name == "fwd":
        o, lse = at.attention_fwd(q, k, v, blocks=blocks)
        assert rel_err(o, truth[0]) <= allowed(rel_err(sdpa[0], truth[0]), dtype)
        return
    o, lse = at.attention_fwd(q, k, v, blocks=PLAIN_FORWARD)
    grads = at.attention_bwd(q, k, v, o, lse, do, blocks=blocks)  # this configuration in both backward kernels
    for label, got, want, theirs in zip("qkv", grads, truth[1:], sdpa[1:]):
        assert rel_err(got, want) <= allowed(rel_err(theirs, want), dtype), f"d{label}"
