"""The training losses of every task, as plain functions: the original training code's, with the weights of the
released configs (docs/losses.md). The task models in heads.py call them when labels are passed.

Matting: the losses of the upstream matting commit (e07a5f8), which came after the first release.
"""

from __future__ import annotations

if __name__ == "losses":  # a bare `import losses` in a checkout gives the one module, sapiens2.losses
    __import__("sapiens2").one_module(__name__)

import torch
import torch.nn.functional as F

from sapiens2.processing import segmentation_metadata


def keypoint_mse_loss(heatmaps, targets, weights=None, loss_weight: float = 10.0):
    """loss_weight * mean over ALL elements of w_{b,k} (P - T)^2 (zero-weight keypoints still count in
    the mean). HF's Sapiens2ForPoseEstimation loss is the same with loss_weight 1."""
    squared = (heatmaps.float() - targets.float()) ** 2
    if weights is not None:
        squared = squared * weights.float()[:, :, None, None]
    return loss_weight * squared.mean()


def seg_cross_entropy(logits, labels, class_weights=None, ignore_index: int = 255, average_over: str = "pixels"):
    """Per-pixel w_y * CE. average_over="pixels" (the original): divide by ALL pixels, ignored included;
    "valid": divide by the non-ignored pixels (torch's / HF's mean, which has no class weights)."""
    per_pixel = F.cross_entropy(logits.float(), labels.long(), weight=class_weights, ignore_index=ignore_index,
                                reduction="none")
    if average_over == "pixels":
        return per_pixel.mean()
    if average_over == "valid":
        if class_weights is not None:
            return per_pixel.sum() / class_weights[labels[labels != ignore_index]].sum().clamp(min=1e-12)
        return per_pixel.sum() / (labels != ignore_index).sum().clamp(min=1)
    raise ValueError(f"average_over must be 'pixels' or 'valid', got {average_over!r}")


def seg_dice_loss(logits, labels, ignore_index: int = 255, eps: float = 1e-3):
    """Multi-class Dice, background excluded, squared denominators, averaged over the classes present in
    each sample and divided by B (samples without foreground contribute 0)."""
    num_classes = logits.shape[1]
    valid = (labels != ignore_index).unsqueeze(1).float()  # (B, 1, H, W)
    probs = logits.float().softmax(dim=1) * valid
    onehot = F.one_hot(labels.masked_fill(labels == ignore_index, 0).long(), num_classes).movedim(-1, 1).float() * valid
    probs, onehot = probs[:, 1:].flatten(2), onehot[:, 1:].flatten(2)  # (B, K-1, HW): no background
    dice = (2 * (probs * onehot).sum(-1) + eps) / (probs.square().sum(-1) + onehot.square().sum(-1) + eps)
    present = (onehot.sum(-1) > 0).float()  # (B, K-1)
    mean_dice = (dice * present).sum(-1) / present.sum(-1).clamp(min=1)
    counted = ((valid.flatten(1).sum(-1) > 0) & (present.sum(-1) > 0)).float()
    return (counted * (1 - mean_dice)).mean()


def seg_loss(logits, labels, class_weights=None):
    """The released configs' loss: weighted CE (the 29 training class weights by default) + Dice."""
    if class_weights is None and logits.shape[1] == len(segmentation_metadata()["train_class_weights"]):
        class_weights = torch.tensor(segmentation_metadata()["train_class_weights"], device=logits.device)
    return seg_cross_entropy(logits, labels, class_weights) + seg_dice_loss(logits, labels)


def masked_pixel_mean(error, mask):
    """MPM: sum over pixels AND channels of error * mask, divided by the number of valid pixels."""
    return (error * mask).sum() / mask.sum().clamp(min=1)


def _finite(x):
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def gradient_l2(pred, target, mask):
    """(E_x, E_y): squared error of forward differences over pixel pairs that are both valid."""
    terms = []
    for dim in (-1, -2):
        n = pred.shape[dim]
        diff = lambda x: x.narrow(dim, 1, n - 1) - x.narrow(dim, 0, n - 1)  # noqa: E731
        pair = mask.narrow(dim, 1, n - 1) * mask.narrow(dim, 0, n - 1)
        terms.append(((diff(pred) - diff(target)) ** 2 * pair).sum() / pair.sum().clamp(min=1))
    return terms


def _empty_mask_guard(loss, pred, mask):
    """The original's rule: an empty mask gives 0 * sum(pred) (zero, but attached to the graph)."""
    return torch.where(mask.sum() > 0, loss, 0 * pred.sum())


def normal_loss(pred, target, mask):
    """10 * cosine + 1 * L1 + 10 * (E_x + E_y) of forward differences."""
    pred, target = pred.float(), target.float()
    cosine = (F.normalize(pred, dim=1, eps=1e-6) * F.normalize(target, dim=1, eps=1e-6)).sum(1, keepdim=True)
    terms = [
        10 * masked_pixel_mean(1 - cosine, mask),
        masked_pixel_mean((pred - target).abs(), mask),
        10 * sum(gradient_l2(pred, target, mask)),
    ]
    return sum(_empty_mask_guard(_finite(t), pred, mask) for t in terms)


def albedo_loss(pred, target, mask):
    """2 * L1 + 2 * mean(E_x, E_y) + 1 * chromaticity L1 (prediction clamped to [0, 1])."""
    pred, target = pred.float(), target.float()
    chroma = lambda x: x / (x.sum(1, keepdim=True) + 1e-6)  # noqa: E731
    terms = [
        _empty_mask_guard(_finite(2 * masked_pixel_mean((pred - target).abs(), mask)), pred, mask),
        _empty_mask_guard(_finite(2 * 0.5 * sum(gradient_l2(pred, target, mask))), pred, mask),
        _finite(masked_pixel_mean((chroma(pred.clamp(0, 1)) - chroma(target)).abs(), mask)),
    ]
    return sum(terms)


def _pointmap_normals(points, mask):
    """Unit normals of a pointmap from reflect-padded forward differences (x100); invalid ones zeroed."""
    padded = F.pad(points, (0, 1, 0, 1), mode="reflect")
    a = (padded[:, :, :-1, 1:] - padded[:, :, :-1, :-1]) * 100  # along x
    b = (padded[:, :, 1:, :-1] - padded[:, :, :-1, :-1]) * 100  # along y
    n = torch.cross(a, b, dim=1)
    length = n.norm(dim=1, keepdim=True)
    valid = (length > 1e-6) & (mask > 0)
    return n / length.clamp(min=1e-6) * valid, valid.float()


def pointmap_loss(pred, pred_scale, target, mask, scale, intrinsics=None):
    """The seven released terms (the K-consistency term only when intrinsics are given):
    2*L1, 1*L1 at 2x, SiLog(Z), K-consistency, shift-invariant L1 (all but SiLog/K on XYZ / mean Z, the
    L1 kinds clamped at 4), 2*normals-from-points, 4*|scale - scale_gt|."""
    pred, target, mask = pred.float(), target.float(), mask.float()
    mu = (target[:, 2:3] * mask).sum((2, 3), keepdim=True) / mask.sum((2, 3), keepdim=True).clamp(min=1)
    p, g = pred / mu, target / mu
    guard = lambda t: _empty_mask_guard(_finite(t), pred, mask)  # noqa: E731
    l1 = guard(2 * masked_pixel_mean((p - g).abs(), mask)).clamp(max=4)
    up = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)  # noqa: E731
    mask2 = F.interpolate(mask, scale_factor=2, mode="nearest")
    multiscale = guard(masked_pixel_mean((up(p) - up(g)).abs(), mask2)).clamp(max=4)
    centred = lambda x: x - (x * mask).sum((2, 3), keepdim=True) / (mask.sum((2, 3), keepdim=True) + 1e-6)  # noqa: E731
    shift_invariant = guard(masked_pixel_mean((centred(p) - centred(g)).abs(), mask)).clamp(max=4)
    terms = [l1, multiscale, silog_loss(pred[:, 2], target[:, 2], mask[:, 0]), shift_invariant]
    if intrinsics is not None:
        terms.append(intrinsics_consistency_loss(pred, mask, intrinsics.float()))
    metric = scale.float().view(-1, 1, 1, 1)
    n_pred, _ = _pointmap_normals(pred / metric, mask)
    n_true, valid = _pointmap_normals(target / metric, mask)
    per_pixel = (1 - (n_pred * n_true).sum(1, keepdim=True).clamp(-1, 1)) + (n_pred - n_true).abs().mean(1, keepdim=True)
    terms.append(2 * (per_pixel * valid).sum() / valid.sum().clamp(min=1))
    terms.append(4 * (pred_scale.float() - scale.float()).abs().mean())
    return sum(terms)


def silog_loss(pred_depth, depth, mask, lam: float = 0.5):
    """Per sample sqrt(mean d^2 - lam (mean d)^2), d = log Z - log Z_hat (both clamped at 1e-4); mean over B."""
    d = torch.log(depth.clamp(min=1e-4)) - torch.log(pred_depth.clamp(min=1e-4))
    valid = (mask > 0) & (depth > -100) & ~torch.isnan(d)
    d = torch.where(valid, d, torch.zeros_like(d)).flatten(1)
    n = valid.flatten(1).sum(-1).float().clamp(min=1e-4)
    return torch.sqrt((d.square().sum(-1) / n) - lam * (d.sum(-1) / n).square()).mean()


def intrinsics_consistency_loss(pred, mask, intrinsics):
    """|X - (u - cx) Z / fx| + |Y - (v - cy) Z / fy| over valid pixels, in canonical units."""
    B, _, H, W = pred.shape
    v, u = torch.meshgrid(torch.arange(H, device=pred.device), torch.arange(W, device=pred.device), indexing="ij")
    fx, fy = intrinsics[:, 0, 0].view(B, 1, 1), intrinsics[:, 1, 1].view(B, 1, 1)
    cx, cy = intrinsics[:, 0, 2].view(B, 1, 1), intrinsics[:, 1, 2].view(B, 1, 1)
    z = pred[:, 2]
    error = (pred[:, 0] - (u - cx) * z / fx).abs() + (pred[:, 1] - (v - cy) * z / fy).abs()
    loss = (error * mask[:, 0]).sum() / mask.sum().clamp(min=1)
    return torch.where(mask.sum() > 0, torch.nan_to_num(loss, nan=0.0), 0 * pred.sum())


# ----------------------------------------------------------------------------------------------------
# Matting: the upstream's losses (commit e07a5f8, sapiens/dense/src/models/losses/matting_loss.py, and the config's
# MattingL1Loss + MattingGradLoss + MattingLaplacianLoss, each weight 1, on alpha and on the masked foreground)
# ----------------------------------------------------------------------------------------------------
def _matting_mask_guard(loss, pred, mask):
    """The upstream returns 0 for an all-invalid mask (here 0 * sum(pred): zero, but attached to the graph)."""
    return loss if mask is None else torch.where(mask.sum() > 0, loss, 0 * pred.sum())


def matting_l1_loss(pred, target, mask=None):
    """MattingL1Loss: the mean over ALL elements of |P - T| * mask (masked-out elements count in the mean)."""
    error = (pred - target).abs()
    error = error if mask is None else error * mask
    return _matting_mask_guard(_finite(error.mean()), pred, mask)


def sobel_gradients(x):
    """(B, C, H, W) -> (d/dx, d/dy) of the 3x3 Sobel kernels per channel, reflect-padded (compute_sobel_gradients)."""
    sobel_x = torch.tensor([[-1.0, 0, 1], [-2, 0, 2], [-1, 0, 1]], dtype=x.dtype, device=x.device)
    kernels = torch.stack([sobel_x, sobel_x.T])[:, None]  # (2, 1, 3, 3): d/dx, d/dy
    B, C, H, W = x.shape
    grads = F.conv2d(F.pad(x.reshape(B * C, 1, H, W), (1, 1, 1, 1), mode="reflect"), kernels)  # (B * C, 2, H, W)
    return grads[:, 0].reshape(B, C, H, W), grads[:, 1].reshape(B, C, H, W)


def matting_gradient_loss(pred, target, mask=None):
    """MattingGradLoss: mean of |‖∇P‖ - ‖∇T‖| * mask, ‖∇‖ = sqrt(gx^2 + gy^2 + 1e-6) of the Sobel
    gradients."""
    magnitude = lambda x: torch.sqrt(sum(g.square() for g in sobel_gradients(x)) + 1e-6)  # noqa: E731
    error = (magnitude(pred) - magnitude(target)).abs()
    error = error if mask is None else error * mask
    return _matting_mask_guard(error.mean(), pred, mask)


def _gaussian_blur_5x5(x):
    """The upstream's gauss_convolution: [1 4 6 4 1]^T [1 4 6 4 1] / 256 per channel, reflect-padded."""
    taps = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0], dtype=x.dtype, device=x.device)
    kernel = (taps[:, None] * taps[None, :] / 256).view(1, 1, 5, 5)
    B, C, H, W = x.shape
    return F.conv2d(F.pad(x.reshape(B * C, 1, H, W), (2, 2, 2, 2), mode="reflect"), kernel).reshape(B, C, H, W)


def laplacian_pyramid(x, levels: int = 5):
    """The upstream's laplacian_pyramid: levels - 1 band-pass images (each level cropped to even H and W, minus the
    upsampled blur-and-decimate of itself; the upsampling puts 4x the pixels on the even grid, zeros between, and
    blurs), then the last low-pass image."""
    bands = []
    for _ in range(levels - 1):
        x = x[:, :, : x.shape[2] // 2 * 2, : x.shape[3] // 2 * 2]  # (B, C, even H, even W)
        down = _gaussian_blur_5x5(x)[:, :, ::2, ::2]
        up = torch.zeros_like(x)
        up[:, :, ::2, ::2] = down * 4
        bands.append(x - _gaussian_blur_5x5(up))
        x = down
    return bands + [x]


def matting_laplacian_loss(pred, target, mask=None, levels: int = 5):
    """MattingLaplacianLoss: sum over levels l of 2^l * mean(|P_l m_l - T_l m_l|), divided by the number of levels;
    m_l is the mask resized (nearest) to level l."""
    loss = 0
    for level, (p, t) in enumerate(zip(laplacian_pyramid(pred, levels), laplacian_pyramid(target, levels))):
        if mask is not None:
            m = F.interpolate(mask.float(), size=p.shape[2:], mode="nearest")
            p, t = p * m, t * m
        loss = loss + 2**level * (p - t).abs().mean()
    return _matting_mask_guard(loss / levels, pred, mask)


MATTING_LOSSES = (matting_l1_loss, matting_gradient_loss, matting_laplacian_loss)  # the config's, each weight 1


def matting_loss(alpha, target, pred_foreground=None, foreground=None, mask=None):
    """The upstream's matting loss: L1 + Sobel-gradient + Laplacian-pyramid on alpha (every pixel), and the same
    three on the premultiplied foreground where `mask` is set, when a foreground target is given. alpha, target:
    (B, 1, H, W); pred_foreground, foreground: (B, 3, H, W); mask: (B, 1, H, W), where the foreground target is
    known (all pixels for an RGBA matte; else the opaque and the fully transparent ones, matting_foreground_target)."""
    alpha, target = alpha.float(), target.float()
    loss = sum(term(alpha, target) for term in MATTING_LOSSES)
    if pred_foreground is not None and foreground is not None:
        pred_foreground, foreground = pred_foreground.float(), foreground.float()
        mask = torch.ones_like(target) if mask is None else mask.float()
        loss = loss + sum(term(pred_foreground, foreground, mask) for term in MATTING_LOSSES)
    return loss


def matting_foreground_target(alpha, image, foreground=None):
    """(foreground target, mask, has_foreground) as the upstream's MattingPackInputs builds them for training. With
    the premultiplied foreground of an RGBA matte ((3, H, W) in [0, 1]): it, every pixel valid. Without (an
    alpha-only matte): the image's RGB where alpha >= 0.996 (254/255: opaque), 0 elsewhere, valid where opaque or
    alpha == 0 (the semi-transparent pixels' colours are unknown). alpha: (1, H, W); image: (3, H, W) RGB in [0, 1]."""
    if foreground is not None:
        return foreground, torch.ones_like(alpha), True
    opaque = alpha >= 0.996
    return image * opaque, (opaque | (alpha == 0)).float(), False
