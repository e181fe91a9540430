"""Checkpoints of other shapes than the released ones, as transformers and the original code write them.

Each test builds a tiny model, writes it the way its library does, loads it with weights.load and compares
the outputs with the writer's own (transformers: fp32 with RoPE "float32", its convention). Tolerances as in
test_heads.py / test_weights.py: 1e-4 for task outputs, 1e-5 for backbone tokens (measured ~1e-7).
"""

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sapiens2 import heads
import sapiens2
from sapiens2 import weights
from conftest import rel_err

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers")

TOL, TOKEN_TOL = 1e-4, 1e-5
OUTPUTS = {"pose": ["heatmaps"], "seg": ["logits"], "normal": ["normals"], "pointmap": ["pointmaps", "scales"],
           "matting": ["alphas", "foregrounds"]}
HF_CLASSES = {"pose": "Sapiens2ForPoseEstimation", "seg": "Sapiens2ForSemanticSegmentation",
              "normal": "Sapiens2ForNormalEstimation", "pointmap": "Sapiens2ForPointmapEstimation",
              "matting": "Sapiens2ForImageMatting"}
PIXEL_SHUFFLE = dict(use_pixel_shuffle=True, upsample_out_channels=[16, 8], upsample_kernel_sizes=[3, 3],
                     conv_out_channels=[8, 4], conv_kernel_sizes=[3, 3])
SCALE_BRANCH = dict(scale_conv_out_channels=[16, 8], scale_final_hidden_sizes=[16, 8])


def hf_task_model(task, directory, head_config, image_size=(64, 48), seed=0, **config):
    """A random transformers task model, saved with save_pretrained (the original key names)."""
    base = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                num_key_value_attention_heads=2, num_first_full_attention_layers=1,
                num_last_full_attention_layers=1, image_size=list(image_size), head_config=head_config)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[task])(transformers.Sapiens2Config(**{**base, **config})).eval()
    with torch.no_grad():  # HF inits LayerScale and the norms to constants: randomize so they matter
        for name, p in model.named_parameters():
            if "norm" in name or "lambda1" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def assert_same_outputs(ours, hf, x, task):
    with torch.no_grad():
        got, want = ours(x), hf(x)
    for name in OUTPUTS[task]:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, name
        err = rel_err(a, b)
        print(f"{task}.{name}: rel err vs transformers {err:.2e}")
        assert err < TOL, name


# ----------------------------------------------------------------------------------------------------
# hidden_act and the config.json audit
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(sapiens2.ACTIVATIONS))
def test_activations_compute_what_transformers_does(name):
    x = torch.linspace(-12, 12, 2001)
    assert torch.allclose(sapiens2.ACTIVATIONS[name](x), transformers.activations.ACT2FN[name](x), rtol=0, atol=1e-6)


def test_hidden_act_gelu_backbone_matches_transformers(tmp_path):
    torch.manual_seed(0)
    config = transformers.Sapiens2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                         intermediate_size=96, image_size=[64, 48], hidden_act="gelu")
    hf = transformers.Sapiens2Model(config).eval()
    hf.save_pretrained(tmp_path)
    ours = weights.load(tmp_path, rope_dtype="float32")
    assert ours.config.hidden_act == "gelu"
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        err = rel_err(ours(x).tokens, hf(x).last_hidden_state)
    assert err < TOKEN_TOL
    with torch.no_grad():  # and the gelu path is really taken: SiLU is far off
        ours.blocks[0].ffn.act = "silu"
        assert rel_err(ours(x).tokens, hf(x).last_hidden_state) > 100 * TOKEN_TOL


def test_hidden_act_reaches_the_pointmap_scale_mlp(tmp_path):
    hf = hf_task_model("pointmap", tmp_path, {**PIXEL_SHUFFLE, **SCALE_BRANCH}, image_size=(128, 96),
                       hidden_act="gelu_pytorch_tanh")
    ours = weights.load(tmp_path, rope_dtype="float32")
    assert_same_outputs(ours, hf, torch.randn(2, 3, 128, 96), "pointmap")


def test_unsupported_config_values_are_refused(tmp_path):
    hf_task_model("seg", tmp_path, dict(upsample_out_channels=[8], conv_out_channels=[8]))
    config = json.loads((tmp_path / "config.json").read_text())
    for field, value, match in [("hidden_act", "prelu", "hidden_act 'prelu' is not supported; use one of silu"),
                                ("key_bias", False, r"asks for \{'key_bias': False\}"),
                                ("use_gated_mlp", False, r"asks for \{'use_gated_mlp': False\}")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=match):
            weights.load(tmp_path)


def test_every_config_field_transformers_writes_is_accounted_for():
    config = transformers.Sapiens2Config(head_config=dict(upsample_out_channels=[8]), num_labels=3).to_dict()
    backbone_tables = [weights.HF_CONFIG_FIELDS, weights.HF_GQA_RULE_FIELDS, weights.HF_HEAD_FIELDS,
                       weights.HF_REQUIRED_VALUES, weights.HF_IRRELEVANT_FIELDS]
    for field in config:
        assert sum(field in table for table in backbone_tables) == 1, field
    head_tables = [weights.HF_HEAD_CONFIG_FIELDS, weights.HF_SCALE_HEAD_FIELDS, weights.HF_HEAD_IRRELEVANT_FIELDS]
    for field in config["head_config"]:
        assert sum(field in table for table in head_tables) == 1, field


def test_a_transformers_config_loads_without_warnings_and_odd_fields_warn(tmp_path):
    hf_task_model("seg", tmp_path, dict(upsample_out_channels=[8], conv_out_channels=[8]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights.load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for extra, match in [(dict(my_field=1), r"fields not used by this implementation: \['my_field'\]"),
                         (dict(attention_dropout=0.1), "attention_dropout=0.1 is not applied"),
                         (dict(semantic_loss_ignore_index=0), "semantic_loss_ignore_index=0 is not applied")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **extra}))
        with pytest.warns(UserWarning, match=match):
            weights.load(tmp_path)


# ----------------------------------------------------------------------------------------------------
# Output counts (id2label), foreign head fields, deeper heads
# ----------------------------------------------------------------------------------------------------


def test_seg_with_4_classes_keeps_their_names_and_ignores_scale_fields(tmp_path):
    names = ["background", "skin", "hair", "clothes"]
    # transformers' own test config carries scale_conv_out_channels for every head; it ignores them, so do we
    hf = hf_task_model("seg", tmp_path, dict(upsample_out_channels=[16, 8], conv_out_channels=[8],
                                             scale_conv_out_channels=[8, 8]),
                       id2label=dict(enumerate(names)))
    assert "num_labels" not in json.loads((tmp_path / "config.json").read_text())  # transformers writes id2label only
    ours = weights.load(tmp_path, rope_dtype="float32")
    assert ours.head_config.out_channels == 4 and ours.labels == tuple(names)
    assert_same_outputs(ours, hf, torch.randn(2, 3, 64, 48), "seg")
    weights.save(ours, tmp_path / "again")  # the names survive our save, and transformers reads them
    assert weights.load(tmp_path / "again").labels == tuple(names)
    assert transformers.Sapiens2ForSemanticSegmentation.from_pretrained(tmp_path / "again").config.id2label[3] == "clothes"


def test_pose_with_17_keypoints_and_its_flip_pairs(tmp_path):
    pairs = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
    hf = hf_task_model("pose", tmp_path, dict(upsample_out_channels=[16, 8], conv_out_channels=[8],
                                              scale_conv_out_channels=[8]),
                       id2label={i: f"kp{i}" for i in range(17)}, flip_pairs=pairs)
    ours = weights.load(tmp_path, rope_dtype="float32")
    assert ours.head_config.out_channels == 17 and ours.labels[16] == "kp16"
    x = torch.randn(2, 3, 64, 48)
    assert_same_outputs(ours, hf, x, "pose")
    with torch.no_grad():
        mirrored = hf(x.flip(-1), flip_pairs=torch.tensor(pairs)).heatmaps
        assert rel_err(ours.flip_test(x), (hf(x).heatmaps + mirrored) / 2) < TOL


@pytest.mark.parametrize("task,channels", [("normal", 5), ("matting", 4)])
def test_pixel_shuffle_heads_with_other_output_counts_and_scale_fields(task, channels, tmp_path):
    hf = hf_task_model(task, tmp_path, {**PIXEL_SHUFFLE, **SCALE_BRANCH}, num_labels=channels)
    ours = weights.load(tmp_path, rope_dtype="float32")
    assert ours.task == task and ours.head_config.out_channels == channels
    assert ours.head_config.scale_conv_channels == ()
    assert_same_outputs(ours, hf, torch.randn(1, 3, 64, 48), task)


def test_transposed_heads_whose_padding_differs_in_transformers_are_refused(tmp_path):
    """transformers pads a transposed head's layers in its own way, which matches the original only for
    the released kernel sizes: other sizes would load and compute something else, so they are refused."""
    hf = hf_task_model("seg", tmp_path, dict(upsample_out_channels=[8], upsample_kernel_sizes=[3],
                                             conv_out_channels=[8], conv_kernel_sizes=[3]))
    with torch.no_grad():
        assert hf(torch.randn(1, 3, 64, 48)).logits.shape[-2:] == (5, 3)  # not 2x the 4x3 feature map
    with pytest.raises(ValueError, match=r"upsample kernels \[3\] and conv kernels \[3\]: only 4 and 1"):
        weights.load(tmp_path)
    # ours (the original's padding) save with our own head field, and refuse the HF format
    ours = heads.build_task_model(sapiens2.Sapiens2Config(32, 2, 2, image_size=(64, 48)),
                                  heads.HeadConfig("seg", (8,), (8,), 4, upsample_kernel_sizes=(3,), conv_kernel_sizes=(3,)))
    weights.save(ours, tmp_path / "ours")
    assert "sapiens2_head_config" in json.loads((tmp_path / "ours" / "config.json").read_text())
    with pytest.raises(ValueError, match="pads transposed heads differently"):
        weights.save(ours, tmp_path / "hf", format="hf")


def test_output_count_is_cross_checked_with_the_predictor(tmp_path):
    hf_task_model("seg", tmp_path / "hf", dict(upsample_out_channels=[8], conv_out_channels=[8]),
                  id2label={i: f"c{i}" for i in range(4)})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["id2label"] = {str(i): f"c{i}" for i in range(5)}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: id2label gives 5 outputs, but the predictor weight has 4"):
        weights.load(tmp_path / "hf")
    ours = heads.build_task_model(sapiens2.Sapiens2Config(32, 2, 2, image_size=(64, 48)),
                                  heads.HeadConfig("seg", (8,), (8,), 4))
    weights.save(ours, tmp_path / "ours.safetensors")
    with pytest.raises(ValueError, match="preset seg-0.4b gives the seg head 29 outputs, but the predictor weight has 4"):
        weights.load(tmp_path / "ours.safetensors", preset="seg-0.4b")
    state = load_file(tmp_path / "ours.safetensors")
    meta = safe_open(str(tmp_path / "ours.safetensors"), "pt").metadata()
    head = json.loads(meta["sapiens2_head_config"])
    meta["sapiens2_head_config"] = json.dumps({**head, "out_channels": 3})
    save_file(state, tmp_path / "edited.safetensors", metadata=meta)
    with pytest.raises(ValueError, match="the file's metadata gives the seg head 3 outputs, but the predictor weight has 4"):
        weights.load(tmp_path / "edited.safetensors")


@pytest.mark.parametrize("task", ["pose", "seg"])
def test_deeper_heads_saved_by_transformers_load(task, tmp_path):
    # more upsample and conv layers than transformers' conversion table names: its save_pretrained writes
    # a mix of original and HF-native names (and loads it back exactly)
    hf = hf_task_model(task, tmp_path, dict(upsample_out_channels=[16, 16, 8, 8, 8], conv_out_channels=[8, 8, 8, 4]),
                       num_labels=5)
    keys = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    assert "decode_head.deconv_layers.0.weight" in keys and "decode_head.upsample_layers.4.convolution.weight" in keys
    assert_same_outputs(weights.load(tmp_path, rope_dtype="float32"), hf, torch.randn(1, 3, 32, 32), task)


@pytest.mark.parametrize("task", ["normal", "pointmap"])
def test_deeper_pixel_shuffle_heads_saved_by_transformers_load(task, tmp_path):
    # 4 refinement convs and (pointmap) 4 scale convs: the 4th of each keeps its HF-native name in the file
    head = {**PIXEL_SHUFFLE, "conv_out_channels": [8, 8, 8, 4], "conv_kernel_sizes": [3, 3, 3, 3]}
    if task == "pointmap":
        head.update(scale_conv_out_channels=[16, 16, 8, 8], scale_final_hidden_sizes=[16, 8])
    hf = hf_task_model(task, tmp_path, head, image_size=(288, 288))
    keys = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    assert "decode_head.conv_layers.3.convolution.weight" in keys
    assert task != "pointmap" or "scale_head.conv_layers.3.convolution.weight" in keys
    assert_same_outputs(weights.load(tmp_path, rope_dtype="float32"), hf, torch.randn(1, 3, 288, 288), task)


# ----------------------------------------------------------------------------------------------------
# Widths from the tensors
# ----------------------------------------------------------------------------------------------------


def test_4k_tokenizer_ffn_width_comes_from_its_own_weights(tmp_path):
    """The original's 4K tokenizer blocks have an FFN of width 4C whatever the main blocks' width is."""
    config = sapiens2.Sapiens2Config(32, 2, 2, ffn_dim=48, use_tokenizer=True, tokenizer_layers=1,
                                     full_attention_first=1, full_attention_last=1)
    model = sapiens2.Sapiens2(config).eval()
    assert model.tokenizer.blocks[0].ffn.w3.weight.shape == (32, 128) and model.blocks[0].ffn.w3.weight.shape == (32, 48)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "bare.safetensors")
    loaded = weights.load(tmp_path / "bare.safetensors")
    assert loaded.config.ffn_dim == 48 and loaded.config.tokenizer_hidden_dim == 128
    x = torch.randn(1, 3, 128, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x).tokens, model(x).tokens)


def test_pointmap_head_of_another_size_from_transformers(tmp_path):
    """transformers writes scale_final_input_size; a bare copy of the same weights loads too, and both run."""
    hf = hf_task_model("pointmap", tmp_path / "hf", {**PIXEL_SHUFFLE, **SCALE_BRANCH}, image_size=(128, 64))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["head_config"]["scale_final_input_size"] == 16
    x = torch.randn(1, 3, 128, 64)
    assert_same_outputs(weights.load(tmp_path / "hf", rope_dtype="float32"), hf, x, "pointmap")
    save_file(load_file(tmp_path / "hf" / "model.safetensors"), tmp_path / "bare.safetensors")
    bare = weights.load(tmp_path / "bare.safetensors", rope_dtype="float32")
    assert bare.head_config.scale_input_width == 16
    assert_same_outputs(bare, hf, x, "pointmap")
