"""The library's training-time options, as timm and transformers users expect them: gradient checkpointing as a
model option, layer-decay parameter groups from keyword arguments, random models that leave the caller's random
state alone (issue 38)."""

import pytest
import torch

from sapiens2 import Sapiens2, Sapiens2Config, heads, layer_decay_groups

TINY = dict(embed_dim=32, depth=3, num_heads=2, full_attention_first=1, full_attention_last=1, image_size=(32, 32))


def tiny_backbone(**overrides) -> Sapiens2:
    torch.manual_seed(0)
    return Sapiens2(Sapiens2Config(**{**TINY, **overrides}))


def gradients(model: Sapiens2, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    out = model(pixels)
    (out.features.square().mean() + out.cls.sum()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------------
# Gradient checkpointing
# ----------------------------------------------------------------------------------------------------
def test_grad_checkpointing_recomputes_the_blocks_and_keeps_the_gradients():
    model = tiny_backbone(drop_path_rate=0.0)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    plain = gradients(model, pixels)
    assert len(calls) == 3  # one forward per block
    calls.clear()
    assert model.set_grad_checkpointing(True) is model and model.grad_checkpointing
    checkpointed = gradients(model, pixels)
    assert len(calls) == 6  # each block again in the backward pass: its activations were not kept
    assert "forward" not in vars(model.blocks[0])  # an option of the model, not a patched block.forward
    # The recomputation runs the same fp32 ops in the same order; the gradients may still sum in another order
    # (autograd accumulates a tensor's gradient contributions as they arrive): a few fp32 ulps of the largest.
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        tol = 8 * torch.finfo(torch.float32).eps * grad.abs().max().item()
        assert torch.allclose(checkpointed[name], grad, rtol=0, atol=tol), name
    with torch.no_grad():  # nothing to recompute without gradients: one forward per block
        calls.clear()
        model(pixels)
        assert len(calls) == 3
    model.set_grad_checkpointing(False)
    calls.clear()
    gradients(model, pixels)
    assert len(calls) == 3


# ----------------------------------------------------------------------------------------------------
# Layer-wise lr decay (tests/test_train_recipe.py checks a task model's groups against the original's code)
# ----------------------------------------------------------------------------------------------------
def test_layer_decay_groups_of_a_bare_backbone_from_keywords():
    model = tiny_backbone()
    groups = layer_decay_groups(model, lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    scale_of = {id(p): (g["lr_scale"], g["weight_decay"], g["lr"]) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(scale_of) == len(named)  # every parameter, once
    depth = 3  # layer 0: tokens and patch embedding; block i: i + 1; the final norm: depth + 1
    assert scale_of[id(named["cls_token"])] == (0.5 ** (depth + 1), 0.05, 1e-3)  # the tokens are decayed
    assert scale_of[id(named["patch_embed.projection.bias"])] == (0.5 ** (depth + 1), 0.0, 1e-3)
    assert scale_of[id(named["blocks.1.attn.wq.weight"])] == (0.5 ** (depth - 1), 0.05, 1e-3)
    assert scale_of[id(named["blocks.2.ln1.weight"])] == (0.5, 0.0, 1e-3)  # 1-D: no weight decay
    assert scale_of[id(named["ln1.weight"])] == (1.0, 0.0, 1e-3)
    with pytest.raises(TypeError):  # keywords only: three floats in a row are easy to swap
        layer_decay_groups(model, 1e-3, 0.05, 0.5)
    with pytest.raises(TypeError, match="holds no Sapiens2 backbone"):
        layer_decay_groups(torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.05, layer_decay=0.5)


# ----------------------------------------------------------------------------------------------------
# Random models
# ----------------------------------------------------------------------------------------------------
def test_random_model_leaves_the_callers_random_state_alone():
    overrides = dict(embed_dim=32, depth=2, num_heads=2)
    torch.manual_seed(123)
    expected_draw = torch.rand(4)
    torch.manual_seed(123)
    model = heads.random_model("features", "0.1b", seed=5, **overrides)
    assert torch.equal(torch.rand(4), expected_draw)  # the caller's generator is where it was
    # The same weights as seeding torch's generator with the seed and building the model (what it did before)
    torch.manual_seed(5)
    before = Sapiens2(Sapiens2Config.from_preset("0.1b", **overrides))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
