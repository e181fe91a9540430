"""train.py's validation metrics of the dense tasks against the original evaluators (facebookresearch/sapiens2
sapiens/dense/src/evaluators/, and the upstream matting evaluator of commit e07a5f8), whose math is copied in
tests/fixtures/original_dense_evaluators.py: the same small random batches through both, the same names in the same
order first, the same numbers.

Tolerances: the original sums each image's values in fp32 and we sum in fp64, over a few hundred pixels here, so
the means agree to ~1e-7 relative; 1e-5 leaves room for the fp32 convolutions (Sobel, SSIM windows) that cv2 and
torch evaluate in different orders. Counts and the histogram median are exact; seg's percentages are rounded to 2
decimals by both."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sapiens2 import heads, losses
import train
from sapiens2_app.train import dense_metrics, datasets

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import original_dense_evaluators as original  # noqa: E402
import upstream_matting_losses as upstream  # noqa: E402

REL = 1e-5


def run_batches(task, info, batches):
    """Metric over (output, batch, valid) triples, as train.evaluate feeds it."""
    metric = dense_metrics.Metric(task, info)
    for output, batch, valid in batches:
        metric.update(output, batch, valid)
    return metric.result()


def assert_original_first(ours: dict, reference: dict, extras: list[str], rel=REL):
    """The original's names in its order, then our extras; every original value equal at rel."""
    assert list(ours) == list(reference) + extras
    for name, value in reference.items():
        assert ours[name] == pytest.approx(float(value), rel=rel, abs=1e-9), name


def random_mask(generator, shape, share=0.7):
    mask = (torch.rand(shape, generator=generator) < share).float()
    mask[..., 0, 0] = 1  # every image has a valid pixel (the original asserts it)
    return mask


# ----------------------------------------------------------------------------------------------------
# Seg
# ----------------------------------------------------------------------------------------------------
def seg_batches(generator, classes=6):
    """Two batches (the last with a padding row of garbage); labels use classes 0-3 only and predictions never
    say 5, so class 5 is absent from both (IoU 0/0) and class 4 from the labels (accuracy 0/0)."""
    batches = []
    for rows in (3, 2):
        labels = torch.randint(0, 4, (rows, 10, 8), generator=generator)
        labels[torch.rand(labels.shape, generator=generator) < 0.1] = 255  # ignored pixels
        logits = torch.randn(rows, classes, 10, 8, generator=generator)
        logits[:, :4] += 2 * torch.nn.functional.one_hot(labels.clamp(max=3), 4).movedim(-1, 1)  # mostly right
        logits[:, 5] = -10
        batches.append((heads.SegOutput(logits), {"labels": labels}, torch.ones(rows)))
    batches[-1][2][-1] = 0  # padding row: not counted
    return batches


def test_seg_metrics_are_the_original_evaluators():
    batches = seg_batches(torch.Generator().manual_seed(1))
    results = []
    for output, batch, valid in batches:
        keep = valid.bool()
        original.seg_process(results, output.logits[keep], batch["labels"][keep])
    reference = original.seg_evaluate(results)  # aAcc, mIoU, mAcc: percent, rounded to 2 decimals
    ours = run_batches("seg", {"out_channels": 6}, batches)
    assert_original_first(ours, reference, [], rel=1e-6)  # the original rounds in fp32: 79.45 is 79.449997
    # absent classes count as 0 in the mean over all 6 classes: the mean over the present ones would be 6/5 of it
    unrounded = original.seg_evaluate(results, rounded=False)
    present_only = original.seg_evaluate(results, nan_to_num=None, rounded=False)
    assert present_only["mIoU"] > 1.15 * unrounded["mIoU"]
    assert ours["mIoU"] == pytest.approx(unrounded["mIoU"], abs=0.005 + 1e-6)


# ----------------------------------------------------------------------------------------------------
# Normal
# ----------------------------------------------------------------------------------------------------
def normal_batches(generator):
    batches = []
    for rows in (2, 2):
        truth = torch.nn.functional.normalize(torch.randn(rows, 3, 12, 10, generator=generator), dim=1)
        spread = torch.rand(rows, 1, 12, 10, generator=generator)  # angles from 0 to ~90 degrees
        predicted = 2.5 * (truth + spread * torch.randn(rows, 3, 12, 10, generator=generator))  # not unit length
        mask = random_mask(generator, (rows, 1, 12, 10))
        batches.append((heads.NormalOutput(predicted), {"labels": truth, "mask": mask}, torch.ones(rows)))
    batches[-1][2][-1] = 0
    return batches


def test_normal_metrics_are_the_original_evaluators():
    batches = normal_batches(torch.Generator().manual_seed(2))
    results = []
    for output, batch, valid in batches:
        keep = valid.bool()
        original.normal_process(results, output.normals[keep], batch["labels"][keep], batch["mask"][keep])
    reference = original.normal_evaluate(results)
    assert list(reference) == ["normal_mae", "normal_median_deg", "normal_rmse", "within_5_0_deg",
                               "within_11_25_deg", "within_22_5_deg", "within_30_0_deg"]
    assert 0 < reference["within_5_0_deg"] < reference["within_30_0_deg"] < 100  # the thresholds are exercised
    assert_original_first(run_batches("normal", {"out_channels": 3}, batches), reference, [])


# ----------------------------------------------------------------------------------------------------
# Pointmap
# ----------------------------------------------------------------------------------------------------
def smooth_surface(generator, rows, h, w):
    """A bumpy surface about 2 m away in the canonical camera, so its normals are meaningful."""
    v, u = torch.meshgrid(torch.linspace(-0.5, 0.5, h), torch.linspace(-0.4, 0.4, w), indexing="ij")
    bumps = 0.1 * torch.randn(rows, 1, h // 4, w // 4, generator=generator)
    z = 2.0 + torch.nn.functional.interpolate(bumps, size=(h, w), mode="bicubic", align_corners=True)[:, 0]
    return torch.stack([u * z, v * z, z], dim=1)  # (rows, 3, H, W)


def pointmap_batches(generator):
    batches = []
    for rows in (2, 2):
        truth = smooth_surface(generator, rows, 16, 12)
        mask = random_mask(generator, (rows, 1, 16, 12), share=0.8)
        noise = 0.003 * torch.randn(rows, 3, 16, 12, generator=generator)
        predicted = 0.6 * truth + 0.4 * smooth_surface(generator, rows, 16, 12) * 1.05 + noise
        scales = torch.rand(rows, 1, generator=generator) + 0.5
        output = heads.PointmapOutput(predicted, scales * 1.1)
        batches.append((output, {"labels": truth * mask, "mask": mask, "scales": scales}, torch.ones(rows)))
    batches[-1][2][-1] = 0
    return batches


def test_sobel_normals_are_cv2s():
    points = smooth_surface(torch.Generator().manual_seed(3), 1, 16, 12)
    valid = torch.ones(16, 12, dtype=torch.bool)
    expected = original.pointmap_surface_normals(points[0].permute(1, 2, 0), valid)  # (N, 3)
    ours = dense_metrics.sobel_normals(points)[0].permute(1, 2, 0).reshape(-1, 3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)  # unit vectors from fp32 5x5 filters


def test_pointmap_metrics_are_the_original_evaluators():
    batches = pointmap_batches(torch.Generator().manual_seed(4))
    results = []
    for output, batch, valid in batches:
        keep = valid.bool()
        original.pointmap_process(results, output.pointmaps[keep], batch["labels"][keep], batch["mask"][keep])
    reference = original.pointmap_evaluate(results)
    assert list(reference)[:7] == ["l2_mean", "x_mae", "y_mae", "z_mae", "rmse", "normal_mae", "normal_rmse"]
    assert 0 < reference["within_05_cm"] < 1
    assert 0 < reference["within_5_0_deg"] < reference["within_30_0_deg"] < 1  # the thresholds are exercised
    assert_original_first(run_batches("pointmap", {"out_channels": 3}, batches), reference, ["abs_rel", "delta1.25"])


# ----------------------------------------------------------------------------------------------------
# Albedo
# ----------------------------------------------------------------------------------------------------
def albedo_batches(generator):
    batches = []
    for rows in (2, 2):
        truth = torch.rand(rows, 3, 24, 20, generator=generator)
        predicted = truth + 0.3 * torch.randn(rows, 3, 24, 20, generator=generator)  # outside [0, 1] too
        mask = torch.zeros(rows, 1, 24, 20)
        mask[:, :, 3:20, 2:17] = 1  # a blob: SSIM windows inside and at the border
        mask = mask * random_mask(generator, mask.shape, share=0.9)
        batches.append((heads.AlbedoOutput(predicted), {"labels": truth, "mask": mask}, torch.ones(rows)))
    batches[-1][2][-1] = 0
    return batches


def test_albedo_metrics_are_the_original_evaluators():
    batches = albedo_batches(torch.Generator().manual_seed(5))
    state = {"results": [], "data_range": None}
    for output, batch, valid in batches:
        keep = valid.bool()
        original.albedo_process(state, output.albedo[keep], batch["labels"][keep], batch["mask"][keep])
    reference = original.albedo_evaluate(state)
    assert state["data_range"] == 1.0
    assert_original_first(run_batches("albedo", {"out_channels": 3}, batches), reference, [])


def test_albedo_psnr_is_of_the_pooled_unclamped_mse():
    """One image with a small error, one with a large one: the PSNR of their pooled MSE, not the mean of their
    PSNRs, and of the raw prediction (clamping to [0, 1] would hide the overshoot)."""
    truth = torch.full((2, 3, 8, 8), 0.9)
    predicted = truth.clone()
    predicted[0] += 0.01
    predicted[1] += 0.3  # 1.2: above 1
    batch = {"labels": truth, "mask": torch.ones(2, 1, 8, 8)}
    psnr = run_batches("albedo", {"out_channels": 3}, [(heads.AlbedoOutput(predicted), batch, torch.ones(2))])["psnr"]
    mse = (0.01**2 + 0.3**2) / 2
    assert psnr == pytest.approx(10 * torch.log10(torch.tensor(1 / mse, dtype=torch.float64)).item(), rel=1e-5)


# ----------------------------------------------------------------------------------------------------
# Matting
# ----------------------------------------------------------------------------------------------------
def test_matting_metrics_are_the_upstream_evaluators():
    generator = torch.Generator().manual_seed(6)
    batches, results = [], []
    for rows, has in ((3, [True, False, True]), (2, [False, True])):
        alpha = torch.rand(rows, 1, 10, 8, generator=generator)
        foreground = torch.rand(rows, 3, 10, 8, generator=generator) * alpha
        predicted = torch.rand(rows, 4, 10, 8, generator=generator)
        output = heads.MattingOutput(predicted[:, 3:], predicted[:, :3])
        batch = {"labels": alpha, "foregrounds": foreground, "has_foreground": torch.tensor(has)}
        batches.append((output, batch, torch.ones(rows)))
    batches[-1][2][-1] = 0
    for output, batch, valid in batches:
        keep = valid.bool()
        predictions = torch.cat([output.foregrounds, output.alphas], dim=1)[keep]
        original.matting_process(results, predictions, batch["labels"][keep], batch["foregrounds"][keep],
                                 batch["has_foreground"][keep])
    reference = original.matting_evaluate(results)
    assert list(reference) == ["l1_alpha", "l1_foreground"]
    assert_original_first(run_batches("matting", {"out_channels": 3}, batches), reference, ["sad", "mse"])
    # alpha-only data (no foreground files): no l1_foreground, as upstream
    alpha_only = [(o, {"labels": b["labels"]}, v) for o, b, v in batches]
    assert list(run_batches("matting", {"out_channels": 3}, alpha_only)) == ["l1_alpha", "sad", "mse"]


# ----------------------------------------------------------------------------------------------------
# Matting losses and targets (upstream commit e07a5f8)
# ----------------------------------------------------------------------------------------------------
def test_matting_loss_is_the_upstreams():
    """L1 + Sobel gradient + Laplacian pyramid on alpha and on the masked foreground, value and gradients, on an
    odd size (60x44: the pyramid crops odd levels to even) and with an empty foreground mask. The same fp32
    operations in the same order: 1e-6."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 4, 60, 44, generator=generator)
    alpha = torch.rand(2, 1, 60, 44, generator=generator)
    foreground = torch.rand(2, 3, 60, 44, generator=generator) * alpha
    for mask in ((torch.rand(2, 1, 60, 44, generator=generator) > 0.3).float(), torch.zeros(2, 1, 60, 44)):
        ours_in, theirs_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = ours_in.sigmoid()
        ours = losses.matting_loss(out[:, 3:], alpha, out[:, :3], foreground, mask)
        theirs = upstream.head_loss(theirs_in.sigmoid(), alpha, foreground, mask.bool())
        ours.backward()
        theirs.backward()
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-9)
    alpha_only = losses.matting_loss(out[:, 3:], alpha)  # no foreground target: the alpha terms alone
    expected = sum(term(out[:, 3:], alpha) for term in (upstream.l1_loss, upstream.grad_loss, upstream.lap_loss))
    assert alpha_only.item() == pytest.approx(expected.item(), rel=1e-6)


def test_matting_targets_are_the_upstreams(tmp_path):
    """train.py's matting samples: an RGBA matte gives the upstream's premultiplied 8-bit foreground, valid
    everywhere; an alpha-only one the image's colours where opaque, valid where opaque or fully transparent."""
    rng = np.random.default_rng(8)
    for kind in ("rgba", "alpha"):
        folder = tmp_path / kind
        image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        alpha = rng.choice([0, 17, 128, 254, 255], (32, 32)).astype(np.uint8)
        for sub in ("images", "alphas"):
            (folder / sub).mkdir(parents=True)
        Image.fromarray(image).save(folder / "images" / "a.png")
        rgba = np.dstack([rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), alpha])
        Image.fromarray(rgba if kind == "rgba" else alpha).save(folder / "alphas" / "a.png")
        sample = datasets.DenseDataset("matting", folder, (32, 32), augment=False)[(0, 0)]
        truth = torch.from_numpy(alpha.astype(np.float32) / 255)[None]
        torch.testing.assert_close(sample["labels"], truth, rtol=0, atol=1e-6)  # network size = image size
        fgr = upstream.premultiplied_foreground(rgba)[0] if kind == "rgba" else None
        pixels = torch.from_numpy(image).permute(2, 0, 1).float()
        expected, mask, known = upstream.pack_foreground_target(truth, pixels, fgr)
        torch.testing.assert_close(sample["foregrounds"], expected, rtol=0, atol=1e-6)  # pixel_values round trip
        assert torch.equal(sample["mask"].bool(), mask) and bool(sample["has_foreground"]) == known
        assert 0 < mask.float().mean() < 1 if kind == "alpha" else mask.all()


def test_train_help_lists_the_original_metric_names(capsys):
    """train.py --help names each dense task's metrics as the evaluators log them."""
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "seg: aAcc, mIoU, mAcc" in text and "matting: l1_alpha, l1_foreground, sad, mse" in text
    assert "albedo: mae, rmse, psnr, ssim, grad_l1" in text and "within_30_0_deg, abs_rel, delta1.25" in text
