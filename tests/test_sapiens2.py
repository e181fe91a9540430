"""The backbone: parity with the original implementation's golden outputs, presets, inputs.

Tolerances (max |ours - reference| / max |reference|):
  * RoPE in fp32 vs the original run with fp32 RoPE: 1e-5 (measured ~5e-7; fp32 op-order noise).
  * RoPE in bf16 vs the original's default bf16 RoPE: 1e-3, a quarter of bf16's epsilon (2^-8). Bit-exactness
    is not reachable: the bf16 rounding of q/k amplifies fp32 last-ulp differences (on the 18-block `tiny` case,
    1e-7 relative perturbations of the input move our own bf16-RoPE output by up to ~5e-4, see
    test_bf16_rope_noise_floor). The test also checks that the other convention is more than twice that away
    (measured 5.7e-3 on `tiny`, 3.2e-3 on `tiny_4k`), so it can tell the two apart.
"""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from sapiens2 import kernels
from conftest import original_case_dir, rel_err
from sapiens2 import PRESETS, Sapiens2, Sapiens2Config, rope_periods_bf16, rope_tables_bf16

FP32_TOL = 1e-5
BF16_ROPE_TOL = 1e-3


def fixture_model(name: str, rope_dtype: str):
    fixtures_dir = original_case_dir(name)
    meta = json.loads((fixtures_dir / f"{name}.json").read_text())
    arch = meta["arch"]
    config = Sapiens2Config(
        embed_dim=arch["embed_dims"],
        depth=arch["num_layers"],
        num_heads=arch["num_heads"],
        ffn_dim=arch["feedforward_channels"],
        kv_heads_per_layer=meta["kv_heads_per_layer"],
        use_tokenizer=meta["use_tokenizer"],
        tokenizer_window=meta["window_size"],
        tokenizer_layers=arch["num_tokenizer_layers"],
        rope_dtype=rope_dtype,
    )
    state = load_file(fixtures_dir / f"{name}.safetensors")
    periods = state.pop("rope_embed.periods")
    model = Sapiens2(config).eval()
    model.load_state_dict(state, strict=True)
    return model, periods, load_file(fixtures_dir / f"{name}.io.safetensors")


@pytest.mark.parametrize("name", ["tiny_4k", "tiny"])
def test_original_fixture_parity(name):
    results = {}
    for rope_dtype in ("float32", "bfloat16"):
        model, _, io = fixture_model(name, rope_dtype)
        with torch.no_grad():
            results[rope_dtype] = model(io["pixel_values"]).tokens
    assert results["float32"].shape == io["tokens"].shape
    err_fp32 = rel_err(results["float32"], io["tokens"])
    err_bf16 = rel_err(results["bfloat16"], io["tokens_rope_bf16"])
    print(f"{name}: fp32 RoPE rel err {err_fp32:.2e}, bf16 RoPE rel err {err_bf16:.2e}")
    assert err_fp32 < FP32_TOL
    assert err_bf16 < BF16_ROPE_TOL
    # the conventions differ by more than the tolerance, so the test can tell them apart
    assert rel_err(results["float32"], io["tokens_rope_bf16"]) > 2 * BF16_ROPE_TOL


def test_bf16_rope_noise_floor():
    """Why BF16_ROPE_TOL is what it is: 1e-7-sized input perturbations move the bf16-RoPE output this much."""
    model, _, io = fixture_model("tiny", "bfloat16")
    with torch.no_grad():
        a = model(io["pixel_values"]).tokens
        floor = max(rel_err(model(io["pixel_values"] * (1 + k * 1e-7)).tokens, a) for k in (1, 2, 3))
    print(f"bf16-RoPE sensitivity to 1e-7 perturbations: {floor:.2e}")
    assert 1e-5 < floor < BF16_ROPE_TOL


def test_rope_periods_match_the_original_buffer():
    _, periods, _ = fixture_model("tiny_4k", "bfloat16")
    assert periods.dtype == torch.bfloat16
    assert torch.equal(rope_periods_bf16(16, 100.0), periods)


def test_rope_periods_bf16_known_values():
    # docs/checkpoints.md, numerics 1: the bf16 periods of head dim 64
    expected = [1, 1.3359375, 1.78125, 2.375, 3.15625, 4.21875, 5.625, 7.5, 10, 13.3125, 17.75, 23.75,
                31.625, 42.25, 56.25, 75]
    assert rope_periods_bf16(64, 100.0).float().tolist() == expected


def test_rope_tables_layout():
    """[y | x | y | x]: dims j and j + D/2 share an angle; y-dims are constant along a row of patches."""
    cos, sin = rope_tables_bf16(16, 100.0, 3, 5)
    assert cos.shape == (15, 16) and cos.dtype == torch.bfloat16
    assert torch.equal(cos[:, :8], cos[:, 8:]) and torch.equal(sin[:, :8], sin[:, 8:])
    grid = cos.float().view(3, 5, 16)
    assert torch.equal(grid[:, :1, :4].expand(3, 5, 4), grid[:, :, :4])  # y-freqs vary with the row only
    assert torch.equal(grid[:1, :, 4:8].expand(3, 5, 4), grid[:, :, 4:8])  # x-freqs with the column only


# ----------------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------------

# docs/checkpoints.md, the architecture: parameter counts of the original architectures (backbone only)
PARAM_COUNTS = {
    "0.1b": 113_993_472,
    "0.4b": 395_450_368,
    "0.8b": 814_283_520,
    "1b": 1_455_474_176,
    "1b-4k": 1_606_588_928,
    "5b": 5_066_902_976,
}
GQA_KV_HEADS = {"0.1b": None, "0.4b": 8, "0.8b": 8, "1b": 12, "1b-4k": 12, "5b": 16}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_with_spec_param_count(name):
    config = Sapiens2Config.from_preset(name)
    with torch.device("meta"):
        model = Sapiens2(config)
    assert sum(p.numel() for p in model.parameters()) == PARAM_COUNTS[name]
    kv = config.layer_kv_heads
    assert kv[:8] == kv[-8:] == (config.num_heads,) * 8
    middle = set(kv[8:-8])
    assert middle == (set() if GQA_KV_HEADS[name] is None else {GQA_KV_HEADS[name]})


def test_preset_table_covers_the_spec():
    assert set(PRESETS) == set(PARAM_COUNTS)
    assert [PRESETS[n].head_dim for n in ("0.4b", "0.8b", "5b")] == [64, 80, 76]


def test_explicit_kv_heads_per_layer():
    config = Sapiens2Config(64, 4, 4, kv_heads_per_layer=[4, 1, 2, 4])
    model = Sapiens2(config)
    assert [b.attn.wk.weight.shape[0] // 16 for b in model.blocks] == [4, 1, 2, 4]
    with pytest.raises(ValueError, match="must divide"):
        Sapiens2Config(64, 2, 4, kv_heads_per_layer=[3, 4])
    with pytest.raises(ValueError, match="entries for 2 blocks"):
        Sapiens2Config(64, 2, 4, kv_heads_per_layer=[4])


# ----------------------------------------------------------------------------------------------------
# Forward: outputs and inputs
# ----------------------------------------------------------------------------------------------------


def tiny_config(**kw):
    return Sapiens2Config(**{**dict(embed_dim=32, depth=4, num_heads=2, full_attention_first=1,
                                    full_attention_last=1), **kw})


def test_outputs_shapes_and_consistency():
    model = Sapiens2(tiny_config()).eval()
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        out = model(x, layers=[1, -1], normalize_layers=False)
        normed = model(x, layers=[1, -1], normalize_layers=True)
    assert out.tokens.shape == (2, 1 + 8 + 3 * 5, 32)
    assert torch.equal(out.cls, out.tokens[:, 0])
    assert torch.equal(out.registers, out.tokens[:, 1:9])
    assert out.features.shape == (2, 32, 3, 5)
    assert torch.equal(out.features.flatten(2).transpose(1, 2), out.tokens[:, 9:])
    # the last block's output, normalized, is exactly the final features
    assert torch.equal(normed.layers[1], out.features)
    assert not torch.allclose(out.layers[1], out.features)  # un-normalized differs
    assert out.layers[0].shape == (2, 32, 3, 5)


def test_block_indices_count_as_a_python_list_and_out_of_range_ones_raise():
    """-1 is the last block; an index past either end names the depth instead of wrapping (23 % 12 == 11
    used to return block 11 of a 12-block model for layers=[23])."""
    model = Sapiens2(tiny_config()).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        out = model(x, layers=[3, -1, 0, -4])
    assert torch.equal(out.layers[0], out.layers[1]) and torch.equal(out.layers[2], out.layers[3])
    message = "block {} does not exist; this model has 4 blocks (0..3, or -4..-1)"
    for argument, index in (("layers", 4), ("layers", -5), ("attentions", 7), ("attentions", -5)):
        with pytest.raises(IndexError, match=re.escape(f"{argument}: " + message.format(index))):
            model(x, **{argument: [0, index]})
    with pytest.raises(TypeError):
        model(x, layers=[1.0])
    with torch.no_grad():
        assert list(model(x, attentions=[-1, 2]).attentions) == [2, 3]  # normalized to 0..depth-1, in block order


def run_blocks_by_hand(model, x):
    """Every block's output token sequence (B, N, C), from the model's own pieces."""
    tokens, h, w = model.embed(x)
    rope = model.rope_embed(h, w, tokens.device, tokens.dtype)
    outputs = []
    for block in model.blocks:
        tokens = block(tokens, rope)
        outputs.append(tokens)
    return outputs


@pytest.mark.parametrize("normalize", [False, True])
def test_layer_cls_and_registers_are_the_blocks_tokens(normalize):
    model = Sapiens2(tiny_config()).eval()
    x = torch.randn(2, 3, 48, 80)
    wanted = [2, -1, 0, 2]
    with torch.no_grad():
        out = model(x, layers=wanted, normalize_layers=normalize)
        by_hand = [model.ln1(t) if normalize else t for t in run_blocks_by_hand(model, x)]
    assert len(out.layer_cls) == len(out.layer_registers) == len(out.layers) == len(wanted)
    for i, cls, registers, patches in zip(wanted, out.layer_cls, out.layer_registers, out.layers, strict=True):
        sequence = torch.cat([cls[:, None], registers, patches.flatten(2).transpose(1, 2)], dim=1)
        assert cls.shape == (2, 32) and registers.shape == (2, 8, 32)
        assert torch.equal(sequence, by_hand[i])  # the same ops in the same order: the same numbers
    if normalize:  # the last block, normalized, is the final output
        assert torch.equal(out.layer_cls[1], out.cls) and torch.equal(out.layer_registers[1], out.registers)


def attention_test_model(**config):
    """A tiny model with GQA in the middle block and LayerScale 1, so the attention branch counts."""
    config = {"rope_dtype": "float32", **config}
    model = Sapiens2(tiny_config(depth=3, num_heads=4, gqa_kv_heads=2, **config)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.gamma.weight.fill_(1.0)
    assert model.config.layer_kv_heads == (4, 2, 4)
    return model


@pytest.mark.parametrize("rope_dtype", ["bfloat16", "float32"])
def test_attentions_are_the_softmax_of_the_normalized_rotated_q_and_k(rope_dtype):
    model = attention_test_model(rope_dtype=rope_dtype)
    x = torch.randn(2, 3, 48, 32)
    B, N, D = 2, 1 + 8 + 3 * 2, 8
    with torch.no_grad():
        out = model(x, attentions=[1, -1])
        inputs = [model.embed(x)[0], *run_blocks_by_hand(model, x)]  # inputs[i]: what block i reads
        rope = model.rope_embed(3, 2, x.device, x.dtype)
        for i in (1, 2):
            attn = model.blocks[i].attn
            z = model.blocks[i].ln1(inputs[i])
            q = attn.wq(z).view(B, N, 4, D).transpose(1, 2)
            k = attn.wk(z).view(B, N, attn.num_kv_heads, D).transpose(1, 2)
            q, k = kernels.qk_norm_rope_reference(q, k, attn.q_norm.weight, attn.k_norm.weight, *rope)
            k = k.repeat_interleave(4 // attn.num_kv_heads, dim=1).double()  # block 1: GQA, key head h // 2
            logits = q.double() @ k.transpose(-1, -2) / D ** 0.5
            want = torch.softmax(logits, dim=-1)  # fp64: the probabilities of these fp32 q and k, near exact
            # The model's fp32 softmax(q k^T * D^-0.5), element by element (u = eps / 2 the fp32 unit
            # roundoff): each logit is off by at most D * u * (|q| |k|^T) * scale for the D-term dot product
            # plus u * |logit| for the scaling; exp(s - max) adds an absolute error u * |s - max| <= 2u * S
            # to its argument and ~1 ulp itself; a probability's relative error is twice the worst argument
            # error (its own exponential and the normalizing sum), plus N * u for the sum of N terms and a
            # few ulps for exp and the division. Measured <= 5.2e-7; the bound is ~9e-6.
            eps = torch.finfo(torch.float32).eps
            S = logits.abs().max().item()
            logit_error = D * eps * (q.abs().double() @ k.abs().transpose(-1, -2)).max().item() / D ** 0.5
            tol = 2 * (logit_error + 2 * S * eps) + (N + 8) * eps
            got = out.attentions[i]
            assert got.shape == (B, 4, N, N) and got.dtype == torch.float32
            assert ((got.double() - want).abs() <= tol * want).all(), i
            # rows are distributions: |sum p - 1| <= sum |p - want| <= tol (the exact rows sum to 1), plus the
            # fp32 rounding of the sum itself (N * u)
            assert (got.sum(-1).double() - 1).abs().max() <= tol + N * eps / 2
    assert list(out.attentions) == [1, 2]


OUTPUT_FIELDS = ("tokens", "cls", "registers", "features", "layers", "layer_cls", "layer_registers")


@pytest.mark.parametrize("rope_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("masked", [False, True])
def test_asking_for_attentions_changes_no_output(rope_dtype, masked):
    """A run with attention maps gives bit for bit the outputs of a run without: the blocks inspected run the
    same attention call as every other block and compute the probabilities beside it."""
    model = attention_test_model(rope_dtype=rope_dtype, use_mask_token=True)
    with torch.no_grad():
        model.mask_token.normal_()
    x = torch.randn(2, 3, 64, 48)
    mask = torch.rand(2, 4 * 3) < 0.5 if masked else None
    every_block = dict(layers=[0, 1, 2], mask=mask)
    with torch.no_grad():
        plain = model(x, **every_block)
        for chosen in ([0], [1], [2], [-2], [0, 1, -1]):  # first, the GQA middle, last, negative, all at once
            inspected = model(x, **every_block, attentions=chosen)
            assert sorted(inspected.attentions) == sorted(i % 3 for i in chosen)
            for name in OUTPUT_FIELDS:
                got, want = getattr(inspected, name), getattr(plain, name)
                pairs = zip(got, want, strict=True) if isinstance(want, tuple) else [(got, want)]
                assert all(torch.equal(g, w) for g, w in pairs), (name, chosen)


def test_attentions_add_the_probabilities_to_the_fused_kernel_of_the_blocks_asked(monkeypatch):
    model = attention_test_model()
    x = torch.randn(2, 3, 64, 48)
    calls = {"attention": 0, "attention_probs": 0, "qk_norm_rope": 0}
    for name in calls:
        def counted(*args, _name=name, _original=getattr(kernels, name), **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    with torch.no_grad():
        model(x, attentions=[1])
    assert calls == {"attention": 3, "attention_probs": 1, "qk_norm_rope": 3}


def test_attentions_of_the_4k_variant_are_the_main_blocks():
    """The tokenizer's blocks keep the fused kernel and are not indexed; the main blocks see 1 + 8 + h*w tokens."""
    model = attention_test_model(use_tokenizer=True, tokenizer_layers=1)
    x = torch.randn(1, 3, 128, 64)
    with torch.no_grad():
        plain = model(x)
        out = model(x, attentions=[0, -1])
    assert list(out.attentions) == [0, 2] and out.features.shape[-2:] == (2, 1)
    assert out.attentions[0].shape == (1, 4, 1 + 8 + 2, 1 + 8 + 2)
    assert torch.equal(out.tokens, plain.tokens)  # the same attention call in every block, maps or not


def test_batch_items_are_independent():
    model = Sapiens2(tiny_config()).eval()
    x = torch.randn(3, 3, 32, 48)
    with torch.no_grad():
        batched = model(x).tokens
        single = model(x[1:2]).tokens
    assert rel_err(batched[1:2], single) < 1e-5


@pytest.mark.parametrize("shape,match", [
    ((1, 3, 40, 48), r"40x48 does not work.*multiple of 16"),
    ((1, 3, 48, 50), r"48x50 does not work"),
    ((1, 1, 48, 48), r"expected 3 channels"),
    ((3, 48, 48), r"expected pixel_values of shape \(B, 3, H, W\)"),
])
def test_bad_input_shapes(shape, match):
    model = Sapiens2(tiny_config())
    with pytest.raises(ValueError, match=match):
        model(torch.randn(*shape))


def test_4k_variant_requires_multiples_of_64():
    model = Sapiens2(tiny_config(use_tokenizer=True, tokenizer_layers=1))
    with pytest.raises(ValueError, match=r"multiple of 64 \(16-pixel patches in 4x4 windows\)"):
        model(torch.randn(1, 3, 96, 64))
    with torch.no_grad():
        out = model(torch.randn(1, 3, 128, 64))
    assert out.features.shape == (1, 32, 2, 1)


def test_mask_token_replaces_masked_patches():
    model = Sapiens2(tiny_config(use_mask_token=True)).eval()
    with torch.no_grad():
        model.mask_token.normal_()
        x = torch.randn(2, 3, 32, 32)
        mask = torch.zeros(2, 4, dtype=torch.bool)
        mask[0, 1] = True
        embedded, _, _ = model.embed(x, mask)
        plain, _, _ = model.embed(x)
    assert torch.equal(embedded[0, 9 + 1], model.mask_token[0, 0])
    assert torch.equal(embedded[1], plain[1]) and torch.equal(embedded[0, 9], plain[0, 9])
    with pytest.raises(ValueError, match="no mask token"):
        Sapiens2(tiny_config())(x, mask=mask)


def test_training_mode_rope_augmentation_and_drop_path():
    config = tiny_config(rope_dtype="float32", rope_shift=0.1, rope_jitter=1.2, rope_rescale=2.0, drop_path_rate=0.5)
    model = Sapiens2(config)
    x = torch.randn(1, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).tokens, model(x).tokens)  # eval: deterministic, no augmentation
        model.train()
        assert not torch.equal(model(x).tokens, model(x).tokens)
    cos_eval = model.eval().rope_embed(2, 2, x.device, x.dtype)[0]
    cos_train = model.train().rope_embed(2, 2, x.device, x.dtype)[0]
    assert not torch.equal(cos_eval, cos_train)
    assert [round(b.drop_path.p, 4) for b in model.blocks] == [0.0, 0.1667, 0.3333, 0.5]


def test_gradients_flow_to_every_parameter():
    model = Sapiens2(tiny_config(use_tokenizer=True, tokenizer_layers=1)).train()
    out = model(torch.randn(2, 3, 64, 64))
    (out.features.square().mean() + out.cls.sum()).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # NOTE: a key bias shifts every logit of a query by the same amount, which softmax ignores: its
    # gradient is exactly zero by construction.
    assert [n for n in no_grad if not n.endswith("attn.wk.bias")] == []
