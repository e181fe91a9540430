"""export.py on tiny random checkpoints: every task to ONNX (run by onnxruntime) and to torch.export, compared
with eager PyTorch; bf16 RoPE kept exactly through ONNX; the failure paths (tolerance exceeded, missing
packages, bad arguments) leave nothing behind.

Tolerances (max |artifact - eager| / max |eager|): ONNX fp32 1e-4 (checks.TOLERANCE; measured 5e-7 to 3.4e-6),
ONNX fp16 1e-2 (ONNX Runtime's CPU provider computes fp16 ops in fp32, eager rounds each op to fp16);
torch.export fp32: equal to eager, bit for bit (the same ATen kernels); bf16: checks.tolerance. The export's own
check bounds are checks.tolerance (looser with bf16 RoPE); the tiny models are held to the tighter values above.
onnx, onnxscript and onnxruntime come from requirements-test.txt.
"""

import json
import math
import os
import sys

import onnx
import onnxruntime
import pytest
import torch
from torch.onnx._internal.exporter import _onnx_program as onnx_program_module

import export
from sapiens2 import heads, kernels, weights
from sapiens2_app.common import artefacts
from sapiens2_app.export import checks, formats, models, quantize
from conftest import rel_err
from sapiens2 import Sapiens2, Sapiens2Config, rope_tables_bf16


SIZE = (64, 48)
POINTMAP_SIZE = (128, 96)  # the scale branch's two stride-2 convs need a grid that keeps 2x2 pixels


def tiny_model(task: str):
    size = POINTMAP_SIZE if task == "pointmap" else SIZE
    config = Sapiens2Config(32, 3, 2, full_attention_first=1, full_attention_last=1, image_size=size)
    if task == "features":
        model = Sapiens2(config)
    else:
        extra = dict(scale_conv_channels=(8, 4), scale_hidden=(8, 4)) if task == "pointmap" else {}
        head = heads.HeadConfig(task, (16, 8), (8, 4), heads.OUT_CHANNELS[task], **extra)  # outputs at H/4 x W/4
        model = heads.build_task_model(config, head)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # so no output is near-constant
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {task: weights.save(tiny_model(task), folder / f"{task}.safetensors") for task in artefacts.TASKS}


def eager(task, checkpoint, pixels, rope="bfloat16", dtype=torch.float32):
    model, _ = models.load_model(task, str(checkpoint), dtype, rope)
    with torch.no_grad():
        return formats.ExportWrapper(model, task)(pixels)


def pixels_for(task, batch, seed=1):
    return checks.example_input(batch, POINTMAP_SIZE if task == "pointmap" else SIZE, seed)


def run_export(*argv) -> int:
    return export.main([str(a) for a in argv])


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("task", artefacts.TASKS)
def test_onnx_matches_eager_at_two_batch_sizes(task, checkpoints, tmp_path, capsys, monkeypatch):
    path = tmp_path / f"{task}.onnx"
    if task == "albedo":  # weights beside the graph (NAME.onnx.data), as for models over 1.5 GB
        monkeypatch.setattr(onnx_program_module, "_LARGE_MODEL_THRESHOLD", 0)
    assert run_export(task, "--model", checkpoints[task], "-o", path, "--dynamic-batch") == 0
    assert "max relative difference vs eager" in capsys.readouterr().out
    assert leftovers(tmp_path) == []
    weights_file = [f"{path.name}.data"] if task == "albedo" else []
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name] + weights_file
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == list(formats.OUTPUTS[task])
    info = json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}["sapiens2"])
    assert info["task"] == task and info["rope_dtype"] == "bfloat16"
    for batch in (1, 3):
        pixels = pixels_for(task, batch)
        got = dict(zip(formats.OUTPUTS[task], session.run(None, {"pixel_values": pixels.numpy()})))
        want = eager(task, checkpoints[task], pixels)
        for name in formats.OUTPUTS[task]:
            err = rel_err(torch.from_numpy(got[name]), want[name])
            print(f"{task}.{name} batch {batch}: ONNX vs eager (bf16 RoPE) {err:.2e}")
            assert got[name].shape == tuple(want[name].shape)
            assert err < 1e-4
    # bf16 RoPE really survived: the fp32-RoPE model is much farther from the ONNX output than eager bf16 is
    name = formats.OUTPUTS[task][0]
    fp32_rope = eager(task, checkpoints[task], pixels, rope="float32")[name]
    onnx_out, bf16_rope = torch.from_numpy(got[name]), want[name]
    print(f"{task}.{name}: vs bf16-RoPE eager {rel_err(onnx_out, bf16_rope):.2e}, "
          f"vs fp32-RoPE eager {rel_err(onnx_out, fp32_rope):.2e}")
    assert rel_err(onnx_out, fp32_rope) > 5 * max(rel_err(onnx_out, bf16_rope), 1e-7)


@pytest.mark.parametrize("task", artefacts.TASKS)
def test_torch_export_round_trip_equals_eager(task, checkpoints, tmp_path):
    path = tmp_path / f"{task}.pt2"
    argv = ["--format", "torch-export", "--dynamic-batch"]
    assert run_export(task, "--model", checkpoints[task], "-o", path, *argv) == 0
    assert leftovers(tmp_path) == []
    program = torch.export.load(str(path)).module()
    for batch in (1, 3):
        pixels = pixels_for(task, batch)
        with torch.no_grad():
            got = program(pixels)
        want = eager(task, checkpoints[task], pixels)
        assert list(got) == list(formats.OUTPUTS[task])
        for name in want:
            assert torch.equal(got[name], want[name]), f"{task}.{name} batch {batch}"


def test_features_from_a_task_checkpoint(checkpoints, tmp_path):
    """`features` takes the backbone of any checkpoint: here a seg model's."""
    path = tmp_path / "backbone.pt2"
    assert run_export("features", "--model", checkpoints["seg"], "-o", path, "--format", "torch-export") == 0
    pixels = pixels_for("seg", 1)
    extra = {"sapiens2.json": ""}
    with torch.no_grad():
        got = torch.export.load(str(path), extra_files=extra).module()(pixels)
        want = weights.load(checkpoints["seg"]).backbone(pixels)
    info = json.loads(extra["sapiens2.json"])
    assert info["task"] == "features" and info["head_config"] is None and info["outputs"] == ["cls", "features"]
    assert list(got) == ["cls", "features"]
    assert torch.equal(got["cls"], want.cls) and torch.equal(got["features"], want.features)


def test_onnx_fp16_fixed_size_by_default_and_size_option(checkpoints, tmp_path, capsys):
    path = tmp_path / "features16.onnx"
    argv = ["--size", "32x64", "--dtype", "fp16"]
    assert run_export("features", "--model", checkpoints["features"], "-o", path, *argv) == 0
    out = capsys.readouterr().out
    assert "(float16, RoPE bfloat16, tolerance 2e-02)" in out
    measured = [float(out.split(f"{name} ")[1].split()[0].rstrip(",")) for name in ("cls", "features")]
    assert max(measured) < 1e-2  # (measured 6e-4; the export's own bound is 2e-2)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [1, 3, 32, 64]  # fixed: batch 1 and the --size
    assert session.get_inputs()[0].type == "tensor(float)"  # the input stays float32; the cast is inside
    assert [o.type for o in session.get_outputs()] == ["tensor(float16)"] * 2
    pixels = checks.example_input(1, (32, 64), seed=3)
    got = session.run(None, {"pixel_values": pixels.numpy()})
    want = eager("features", checkpoints["features"], pixels, dtype=torch.float16)
    assert got[1].shape == (1, 32, 2, 4)
    err = rel_err(torch.from_numpy(got[1]), want["features"])
    print(f"features fp16 ONNX vs eager: {err:.2e}")
    assert err < 1e-2
    with pytest.raises(Exception):  # a fixed batch axis: batch 2 is refused
        session.run(None, {"pixel_values": checks.example_input(2, (32, 64)).numpy()})


# int8 vs fp32 on the tiny models: int8 weights (one scale per tensor: steps of max|w| / 127) and uint8 activations
# (steps of 1/255 of each tensor's range) move each output by about a percent of its range (measured on the check
# input: seg logits 1.7e-2 max relative, 99.5% of pixels of the same class; pose heatmaps 2.4e-2, peaks 0.44 px
# apart on a 16x12 heatmap, where two random peaks are ~6 px apart). The bars are several times that: they catch a
# broken quantization (a scale or layout mix-up moves outputs by their whole range), not a percent.
INT8_BARS = {"max relative": 0.1, "pixels of the same class": 0.9, "keypoint distance px": 2.0}


def printed_agreement(out: str) -> dict[str, float]:
    """The numbers of export.py's `int8 vs fp32 export ...:` line, by name."""
    line = next(line for line in out.splitlines() if line.startswith("int8 vs fp32 export"))
    numbers = {}
    for item in line.split(": ", 1)[1].split(", "):
        name, value = item.rsplit(" ", 1)
        numbers[name] = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    return numbers


@pytest.mark.parametrize("task", ["seg", "pose"])
def test_onnx_int8_is_smaller_runs_and_agrees_with_fp32(task, checkpoints, tmp_path, capsys, monkeypatch):
    fp32, int8 = tmp_path / "fp32" / f"{task}.onnx", tmp_path / "int8" / f"{task}.onnx"
    if task == "pose":  # weights beside the graph (NAME.onnx.data), as for models over 1.5 GB: int8 keeps them there
        monkeypatch.setattr(onnx_program_module, "_LARGE_MODEL_THRESHOLD", 0)
    assert run_export(task, "--model", checkpoints[task], "-o", fp32) == 0
    assert run_export(task, "--model", checkpoints[task], "-o", int8, "--quantize", "int8") == 0
    out = capsys.readouterr().out
    weights_file = [f"{int8.name}.data"] if task == "pose" else []
    assert sorted(p.name for p in int8.parent.iterdir()) == [int8.name] + weights_file  # no fp32 or staging left
    print(f"{task}: int8 {formats.onnx_bytes(int8)} bytes, fp32 {formats.onnx_bytes(fp32)} bytes")
    assert formats.onnx_bytes(int8) < 0.8 * formats.onnx_bytes(fp32)
    model = onnx.load(str(int8))
    assert "MatMulInteger" in {node.op_type for node in model.graph.node}
    info = json.loads({p.key: p.value for p in model.metadata_props}["sapiens2"])
    assert info["quantization"] == quantize.QUANTIZATION["int8"]
    numbers = printed_agreement(out)
    print(task, numbers)
    name = formats.OUTPUTS[task][0]
    assert 0 < numbers[f"{name} max relative"] <= INT8_BARS["max relative"]  # 0: nothing was quantized
    if task == "seg":
        assert numbers["pixels of the same class"] >= INT8_BARS["pixels of the same class"]
    else:
        assert numbers["keypoint distance px"] <= INT8_BARS["keypoint distance px"]
    pixels = pixels_for(task, 1)  # another input than the check's, through onnxruntime
    session = onnxruntime.InferenceSession(str(int8), providers=["CPUExecutionProvider"])
    got = dict(zip(formats.OUTPUTS[task], map(torch.from_numpy, session.run(None, {"pixel_values": pixels.numpy()}))))
    assert rel_err(got[name], eager(task, checkpoints[task], pixels)[name]) <= INT8_BARS["max relative"]


def test_int8_agreement_numbers_on_known_outputs():
    logits = torch.zeros(1, 3, 2, 2)
    logits[0, 0] = 1  # class 0 everywhere
    moved = logits.clone()
    moved[0, 2, 1, 1] = 2  # one pixel of four becomes class 2
    numbers = quantize.int8_agreement("seg", {"logits": moved}, {"logits": logits})
    assert numbers == {"logits max relative": 2.0, "logits mean abs": 2 / 12, "pixels of the same class": 0.75}
    heatmaps = torch.zeros(1, 2, 8, 8)
    heatmaps[0, :, 1, 1] = 1
    shifted = torch.zeros(1, 2, 8, 8)
    shifted[0, 0, 1, 1] = shifted[0, 1, 5, 4] = 1  # the second keypoint's peak moves by (3, 4): 5 pixels
    assert quantize.int8_agreement("pose", {"heatmaps": shifted}, {"heatmaps": heatmaps})["keypoint distance px"] == 2.5
    normals = torch.tensor([1.0, 0, 0]).view(1, 3, 1, 1)
    turned = torch.tensor([0.0, 1, 0]).view(1, 3, 1, 1)
    angle = quantize.int8_agreement("normal", {"normals": turned}, {"normals": normals})["normal angle deg"]
    assert angle == pytest.approx(90.0, abs=1e-9)


def test_int8_outputs_that_are_not_finite_fail_the_check(checkpoints, tmp_path, monkeypatch, capsys):
    real_run = quantize.run_onnx

    def nan_from_int8(file, pixels):  # the fp32 export is checked in the staging folder's fp32/
        outputs = real_run(file, pixels)
        return outputs if file.parent.name == "fp32" else {name: t * math.nan for name, t in outputs.items()}

    monkeypatch.setattr(quantize, "run_onnx", nan_from_int8)
    assert run_export("seg", "--model", checkpoints["seg"], "-o", tmp_path / "seg.onnx", "--quantize", "int8") == 1
    err = capsys.readouterr().err
    assert "error: the int8 model's logits has values that are not finite: " in err and "not written" in err
    assert list(tmp_path.iterdir()) == []


def test_torch_export_bf16_within_its_tolerance(checkpoints, tmp_path):
    """Not bit-identical in bf16: eager SwiGLU works in place at inference and hands w3 a strided tensor, whose
    bf16 matmul rounds differently from the exported graph's contiguous one (equal in fp32)."""
    path = tmp_path / "normal.pt2"
    assert run_export("normal", "--model", checkpoints["normal"], "-o", path, "--format", "torch-export",
                      "--dtype", "bf16") == 0
    pixels = pixels_for("normal", 1)
    with torch.no_grad():
        got = torch.export.load(str(path)).module()(pixels)["normals"]
    want = eager("normal", checkpoints["normal"], pixels, dtype=torch.bfloat16)["normals"]
    err = rel_err(got, want)
    print(f"normal bf16 torch.export vs eager: {err:.2e}")
    assert got.dtype == torch.bfloat16 and err < checks.tolerance(torch.bfloat16, "bfloat16")


def test_bf16_rope_is_bit_exact_in_onnx(tmp_path):
    """The RoPE rotation alone (fp32 q in, bf16 tables, every step rounded to bf16) through ONNX Runtime gives
    PyTorch's bits: what emulate_bf16_arithmetic promises, with no matmul in the way to hide a difference."""
    cos, sin = rope_tables_bf16(16, 100.0, 4, 3)

    class Rope(torch.nn.Module):
        def forward(self, q):
            return kernels.rope_reference(q, cos, sin)

    q = torch.randn(2, 2, 9 + 12, 16) * 3
    with torch.no_grad(), formats.quiet_exporter():
        program = torch.onnx.export(Rope().eval(), (q,), dynamo=True, opset_version=formats.ONNX_OPSET, verbose=False)
    assert formats.emulate_bf16_arithmetic(program.model) >= 2  # (the multiplications and the addition)
    program.save(str(tmp_path / "rope.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "rope.onnx"), providers=["CPUExecutionProvider"])
    for seed in range(3):
        q = torch.randn(2, 2, 21, 16, generator=torch.Generator().manual_seed(seed)) * 3
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: q.numpy()})[0])
        assert torch.equal(got, kernels.rope_reference(q, cos, sin))


def test_onnx_cast_rounds_to_nearest_even_like_torch():
    """emulate_bf16_arithmetic is exact only if ONNX Runtime's fp32 -> bf16 Cast rounds as PyTorch does."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["b"], to=TensorProto.BFLOAT16),
         helper.make_node("Cast", ["b"], ["y"], to=TensorProto.FLOAT)],
        "round_trip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", formats.ONNX_OPSET)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = torch.randn(20000) * torch.randn(20000).mul(8).exp()
    bf16 = torch.randn(20000).bfloat16().float()
    ulp = bf16.abs() * 2.0**-7  # exact ties: a bf16 value plus half of its last place (when a power of 2)
    x = torch.cat([values, bf16 + ulp / 2, bf16 - ulp / 4, bf16 + ulp * 0.75])
    y = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
    assert torch.equal(y, x.bfloat16().float())


@pytest.mark.parametrize("conventions, drift, bound", [("transformers", 2e-4, "1e-04"), ("original", 3e-3, "2e-03")])
def test_check_failure_exits_1_and_keeps_nothing(conventions, drift, bound, checkpoints, tmp_path, monkeypatch, capsys):
    path = tmp_path / "seg.pt2"
    path.write_bytes(b"an earlier export")
    write, run = formats.WRITERS["torch-export"]

    def drifting_run(artifact, pixels):
        outputs = run(artifact, pixels)
        return {name: t + drift * t.abs().max() for name, t in outputs.items()}

    monkeypatch.setitem(formats.WRITERS, "torch-export", (write, drifting_run))
    argv = ["--format", "torch-export", "--conventions", conventions]
    assert run_export("seg", "--model", checkpoints["seg"], "-o", path, *argv) == 1
    err = capsys.readouterr().err
    assert f"differs from eager by more than {bound}" in err and "not written" in err
    assert path.read_bytes() == b"an earlier export"  # untouched: only a checked file replaces it
    assert leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["seg.pt2"]


def test_export_error_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    def broken_writer(wrapper, example, path, dynamic_batch, info):
        path.write_bytes(b"half")
        raise RuntimeError("exporter crashed")

    monkeypatch.setitem(formats.WRITERS, "torch-export", (broken_writer, None))
    with pytest.raises(RuntimeError, match="exporter crashed"):
        run_export("seg", "--model", checkpoints["seg"], "-o", tmp_path / "seg.pt2", "--format", "torch-export")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("missing", ["onnxscript", "onnxruntime"])
def test_missing_onnx_package_one_line_hint(missing, checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    assert run_export("seg", "--model", checkpoints["seg"], "-o", tmp_path / "seg.onnx") == 2
    err = capsys.readouterr().err
    assert err == f"error: --format onnx needs {missing}: {checks.ONNX_HINT}\n"
    assert list(tmp_path.iterdir()) == []


def test_missing_quantization_tools_one_line_hint(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime.quantization", None)  # makes its import raise ImportError
    assert run_export("seg", "--model", checkpoints["seg"], "-o", tmp_path / "seg.onnx", "--quantize", "int8") == 2
    err = capsys.readouterr().err
    assert err == f"error: --quantize int8 needs onnxruntime.quantization: {checks.QUANTIZE_HINT}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["pointmap", "--size", "64x48"], "--size 64x48: a 64x48 input does not fit the pointmap scale branch"),
    (["seg", "--dtype", "bf16"], "--format onnx --dtype bf16: ONNX Runtime has no bf16 kernels"),
    (["seg", "-o", "{tmp}/seg.pt2"], "a onnx file should end in .onnx"),
    (["seg", "-o", "{tmp}/a_file/seg.onnx"], "cannot create its folder"),
    (["seg", "-o", "{tmp}/folder.onnx"], "is a folder"),
    (["features", "--model", "{tmp}/nothing.safetensors"], "no such file"),
    (["seg", "--quantize", "int8", "--format", "torch-export", "-o", "{tmp}/seg.pt2"],
     "--quantize int8 is for --format onnx"),
    (["seg", "--quantize", "int8", "--dtype", "fp16"],
     "--quantize int8 quantizes an fp32 export; drop --dtype float16"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, checkpoints, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "folder.onnx").mkdir()
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(checkpoints[argv[0]])]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out" / "model.onnx")]
    assert run_export(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_unwritable_output_exit_2(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(checks.os, "access", lambda path, mode: False)  # (as root, chmod would not stop us)
    assert run_export("seg", "--model", checkpoints["seg"], "-o", tmp_path / "seg.onnx") == 2
    assert "not writable" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size, message", [("1024by768", "size must be HEIGHTxWIDTH"),
                                           ("60x48", "each side must be a multiple of 16 from 32 to 4096")])
def test_malformed_size_is_an_argparse_error(size, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        export.main(["seg", "-o", "x.onnx", "--size", size])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_one_size_parser_for_every_command():
    """predict.py, train.py and export.py read --size with one function: the same forms (HxW, HXW, H,W) and the
    same limits (multiples of the patch size, 32 to 4096)."""
    import argparse

    import predict
    import train

    assert export.parse_size is train.parse_size is predict.parse_size
    assert [predict.parse_size(t) for t in ("1024x768", "1024X768", " 512,384 ")] == [(1024, 768), (1024, 768),
                                                                                     (512, 384)]
    for bad in ("1000x768", "16x16", "8192x768", "1024by768"):
        with pytest.raises(argparse.ArgumentTypeError):
            predict.parse_size(bad)


@pytest.mark.skipif(not os.environ.get("SAPIENS2_SLOW_TESTS"), reason="AOTInductor compiles C++ (~45 s on 2 cores); "
                    "set SAPIENS2_SLOW_TESTS=1")
def test_aoti_package_matches_eager(checkpoints, tmp_path):
    path = tmp_path / "features.pt2"
    assert run_export("features", "--model", checkpoints["features"], "-o", path, "--format", "aoti") == 0
    pixels = pixels_for("features", 1)
    with torch.no_grad():
        got = torch._inductor.aoti_load_package(str(path))(pixels)
    want = eager("features", checkpoints["features"], pixels)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-4


def test_random_init_exports_offline_and_says_so(tmp_path, monkeypatch, capsys):
    """--random-init always: no checkpoint is looked for (tests run offline, with an empty cache: conftest); the
    artifact's metadata and the log say the weights are random. A tiny backbone preset keeps it fast."""
    import sapiens2

    tiny = Sapiens2Config(32, 2, 2, full_attention_first=1, full_attention_last=1)
    monkeypatch.setitem(sapiens2.PRESETS, "tiny", tiny)
    path = tmp_path / "seg.pt2"
    assert run_export("seg", "--model", "0.4b", "--random-init", "always", "--random-backbone", "tiny",
                      "--size", "64x48", "--format", "torch-export", "-o", path) == 0
    assert capsys.readouterr().err.count("RANDOM WEIGHTS for seg") == 2  # before and after, as predict.py
    extra = {"sapiens2.json": ""}
    program = torch.export.load(str(path), extra_files=extra).module()
    info = json.loads(extra["sapiens2.json"])
    assert info["random_weights"] is True and info["sapiens2_config"]["embed_dim"] == 32
    assert info["head_config"]["upsample_channels"] == [512, 256, 128, 64]  # the released seg-0.4b head
    with torch.no_grad():
        assert program(checks.example_input(1, (64, 48)))["logits"].shape == (1, 29, 64, 48)
    assert run_export("seg", "--model", "0.4b", "--random-backbone", "tiny", "-o", tmp_path / "x.pt2",
                      "--format", "torch-export") == 2  # never (the default): offline, 0.4b cannot be had
    assert "error: " in capsys.readouterr().err and not (tmp_path / "x.pt2").exists()
