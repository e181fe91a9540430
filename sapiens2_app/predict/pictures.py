"""Pictures of results, all PIL images: pose skeletons, segmentation overlays, normal and depth maps, attention
heat maps. The colours and skeleton are the original demos' (data/*.json, read through processing).
"""

from __future__ import annotations

from typing import Sequence

import torch
from PIL import Image, ImageDraw

from sapiens2.processing import (coco17_indices, coco17_names, keypoint_metadata, load_image, resize,
                        segmentation_metadata)


def to_pil(image) -> Image.Image:
    """`(3, H, W)` uint8 tensor, or anything `load_image` reads -> RGB PIL image."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    return Image.fromarray(load_image(image).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy())


def draw_pose(image, people: list[dict], keypoint_set: str = "308", threshold: float = 0.3,
              radius: int | None = None, thickness: int | None = None, names: Sequence[str] | None = None
              ) -> Image.Image:
    """Skeleton over the image with the original colours (links then keypoints; only points with
    score > threshold, as `kpt_thr` in vis_pose.py). `keypoint_set="coco17"` draws the 17 COCO body keypoints
    and the links of the 308 skeleton between them. Radius/thickness default to ~0.5% of the image size.
    `names`: the keypoint names of a model with a set of its own (people's labels index them; `keypoint_set`
    is then ignored): the 308 names draw the 308 skeleton, exactly COCO's 17 names the COCO-17 one, any other
    set its points only (distinct colours), as no skeleton is known for it.
    """
    canvas = to_pil(image).copy()
    draw = ImageDraw.Draw(canvas)
    radius = radius or max(2, round(min(canvas.size) / 200))
    thickness = thickness or max(1, radius // 2)
    links, link_colors, point_ids, point_colors = _skeleton(keypoint_set) if names is None else _skeleton_of(names)
    for person in people:
        points = _visible_points(person, threshold)
        for (a, b), color in zip(links, link_colors):
            if a in points and b in points:
                draw.line([points[a], points[b]], fill=tuple(color), width=thickness)
        for k, color in zip(point_ids, point_colors):
            if k in points:
                x, y = points[k]
                draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=tuple(color))
    return canvas


def _skeleton(keypoint_set: str):
    meta = keypoint_metadata()
    links, link_colors = meta["skeleton_links"], meta["skeleton_link_colors"]
    if keypoint_set == "308":
        return links, link_colors, range(meta["num_keypoints"]), meta["keypoint_colors"]
    if keypoint_set == "coco17":
        subset = set(coco17_indices())
        kept = [(link, color) for link, color in zip(links, link_colors) if set(link) <= subset]
        return ([l for l, _ in kept], [c for _, c in kept], coco17_indices(),
                [meta["keypoint_colors"][k] for k in coco17_indices()])
    raise ValueError(f"keypoint_set must be '308' or 'coco17', got {keypoint_set!r}")


def _skeleton_of(names: Sequence[str]):
    """`_skeleton` in the indexing of a model's own keypoint `names`."""
    names = tuple(names)
    if names == tuple(keypoint_metadata()["keypoint_names"]):
        return _skeleton("308")
    if names == coco17_names():
        links, link_colors, ids, colors = _skeleton("coco17")
        position = {k: i for i, k in enumerate(ids)}  # 308 index -> COCO index
        return [[position[a], position[b]] for a, b in links], link_colors, range(len(ids)), colors
    return [], [], range(len(names)), distinct_colors(len(names))  # no known skeleton: points only


def distinct_colors(count: int) -> list[tuple[int, int, int]]:
    """`count` deterministic, pairwise distinct RGB colours: hues a golden-ratio step apart, three brightness
    levels (distinct up to 4096 colours)."""
    colors, seen = [], set()
    for i in range(10 * count + 100):
        if len(colors) == count:
            break
        hue, value = (i * 0.6180339887) % 1.0, (1.0, 0.75, 0.5)[(i // 7) % 3]
        color = tuple(round(255 * c) for c in _hsv_to_rgb(hue, 0.75, value))
        if color not in seen:
            seen.add(color)
            colors.append(color)
    if len(colors) < count:
        raise ValueError(f"cannot make {count} distinct colours")
    return colors


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[float, float, float]:
    i, f = int(h * 6) % 6, (h * 6) % 1
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    return [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]


def segmentation_palette(num_classes: int = 29) -> list[tuple[int, int, int]]:
    """One RGB colour per class: the released palette for the released 29 classes, else `distinct_colors`
    (a fine-tune's classes are not the released ones, so they do not borrow their colours)."""
    colors = segmentation_metadata()["palette_rgb"]
    return [tuple(c) for c in colors] if num_classes == len(colors) else distinct_colors(num_classes)


def _visible_points(person: dict, threshold: float) -> dict[int, tuple[float, float]]:
    keypoints, scores, labels = (person[k].detach().cpu().tolist() for k in ("keypoints", "scores", "labels"))
    return {int(k): tuple(xy) for k, xy, s in zip(labels, keypoints, scores) if s > threshold}


def colorize_segmentation(segmentation: torch.Tensor, num_classes: int = 29) -> torch.Tensor:
    """`(H, W)` class ids -> `(3, H, W)` uint8 colours of `segmentation_palette(num_classes)` (ids outside
    [0, num_classes) are black)."""
    colors = torch.tensor(segmentation_palette(num_classes), dtype=torch.uint8, device=segmentation.device)
    palette = torch.cat([colors, torch.zeros(1, 3, dtype=torch.uint8, device=segmentation.device)])
    ids = segmentation.long()
    ids = torch.where((ids >= 0) & (ids < num_classes), ids, num_classes)  # outside: the black last row
    return palette[ids].permute(2, 0, 1)


def overlay_segmentation(image, segmentation: torch.Tensor, opacity: float = 0.5, num_classes: int = 29
                         ) -> Image.Image:
    """Palette colours blended over the image, `(1 - opacity) * image + opacity * colour`, rounded
    (cv2.addWeighted in the original SegVisualizer, opacity 0.5). `num_classes`: the model's class count
    (`segmentation_palette`)."""
    image = load_image(image).to(segmentation.device)
    if image.shape[-2:] != segmentation.shape[-2:]:
        raise ValueError(f"image is {tuple(image.shape[-2:])} but the segmentation is {tuple(segmentation.shape)}")
    colours = colorize_segmentation(segmentation, num_classes)
    if opacity == 0.5 and image.dtype == torch.uint8:
        return to_pil(half_blend(image, colours))
    blended = (1 - opacity) * image.float() + opacity * colours.float()
    return to_pil(blended.round().clamp(0, 255).to(torch.uint8))


def half_blend(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """round((a + b) / 2) of uint8 images, rounding halves to even as torch.round does, in integers: what the
    float formula gives at opacity 0.5 (0.5 a + 0.5 b is exact in float32 for 8-bit values), at a fraction of its
    cost on a CPU."""
    total = a.to(torch.int16) + b  # (the sum needs 9 bits)
    half = total >> 1
    return (half + (total & half & 1)).to(torch.uint8)  # an odd sum ends in .5: up only when that makes it even


def normals_to_image(normals: torch.Tensor, mask: torch.Tensor | None = None,
                     background=(0, 0, 0)) -> Image.Image:
    """Unit normals `(3, H, W)` -> RGB image `(n + 1) / 2 * 255` (x, y, z -> R, G, B, original vis_normal.py);
    pixels outside `mask` get the `background` colour."""
    rgb = ((normals.float() + 1) / 2 * 255).clamp(0, 255).to(torch.uint8)
    return to_pil(_apply_mask(rgb, mask, background))


def depth_to_image(depth: torch.Tensor, mask: torch.Tensor | None = None, background=(0, 0, 0)) -> Image.Image:
    """Depth `(H, W)` -> turbo-coloured RGB image, near = red, far = blue, min/max over the masked pixels."""
    valid = torch.isfinite(depth) if mask is None else (mask.bool() & torch.isfinite(depth))
    if not valid.any():
        raise ValueError("depth_to_image: no valid depth pixels (mask empty or depth not finite)")
    near, far = depth[valid].min(), depth[valid].max()
    closeness = ((far - depth) / (far - near).clamp(min=1e-8)).clamp(0, 1).nan_to_num(0)
    rgb = turbo_colormap(closeness)
    return to_pil(_apply_mask(rgb, valid, background))


def turbo_colormap(values: torch.Tensor) -> torch.Tensor:
    """Values in [0, 1] `(H, W)` -> `(3, H, W)` uint8 Turbo colours (blue -> green -> yellow -> red)."""
    anchors = torch.tensor(TURBO_ANCHORS, dtype=torch.float32, device=values.device)  # (33, 3)
    position = values.float().clamp(0, 1).nan_to_num(0) * (len(TURBO_ANCHORS) - 1)
    low = position.floor().long().clamp(max=len(TURBO_ANCHORS) - 2)
    fraction = (position - low)[..., None]
    rgb = anchors[low] * (1 - fraction) + anchors[low + 1] * fraction  # (H, W, 3), linear between anchors
    return rgb.round().to(torch.uint8).permute(2, 0, 1)


# Turbo (Mikhailov 2019, Google, Apache-2.0) sampled at 33 evenly spaced points of its published 256-entry
# table; linear interpolation between them reproduces every table entry to within 2 grey levels.
TURBO_ANCHORS = (
    (48, 18, 59), (57, 42, 115), (64, 64, 161), (68, 86, 199), (70, 107, 227), (70, 127, 246), (66, 147, 255),
    (55, 167, 250), (41, 187, 236), (29, 205, 216), (24, 220, 195), (30, 232, 176), (49, 242, 153),
    (76, 249, 126), (107, 253, 100), (138, 255, 77), (163, 253, 60), (184, 247, 53), (204, 237, 52),
    (222, 224, 55), (237, 208, 58), (248, 192, 58), (253, 174, 53), (254, 152, 44), (251, 128, 34),
    (245, 104, 23), (236, 82, 15), (224, 64, 9), (210, 49, 5), (192, 35, 2), (172, 23, 1), (149, 13, 1),
    (122, 4, 3),
)


def _apply_mask(rgb: torch.Tensor, mask: torch.Tensor | None, background) -> torch.Tensor:
    if mask is None:
        return rgb
    fill = torch.tensor(background, dtype=torch.uint8, device=rgb.device).view(3, 1, 1)
    return torch.where(mask.bool().to(rgb.device), rgb, fill)


def attention_to_image(grid: torch.Tensor, image=None, opacity: float = 0.6, size: tuple[int, int] | None = None
                       ) -> Image.Image:
    """An `(h, w)` attention map (`attention_grid`) as a Turbo heat map, min blue to max red, as a PIL image.

    With `image` (anything `load_image` reads), the map is resized bilinearly to the image and blended over it,
    `(1 - opacity) * image + opacity * colour`, rounded; the map is taken to cover the whole image, as the model
    input of `preprocess` without padding does (for `pad=True`, crop the grid to the content first). Without
    `image`, the heat map alone at `size` (default: 16 pixels a cell).
    """
    if grid.dim() != 2:
        raise ValueError(f"attention map of shape {tuple(grid.shape)} is not (h, w); pick a head or average them")
    if not 0 <= opacity <= 1:
        raise ValueError(f"opacity must be in [0, 1], got {opacity}")
    picture = load_image(image).float() if image is not None else None
    size = tuple(picture.shape[-2:]) if picture is not None else tuple(size or (16 * grid.shape[0], 16 * grid.shape[1]))
    low, high = grid.float().min(), grid.float().max()
    scaled = (grid.float() - low) / (high - low).clamp(min=1e-12)  # [0, 1]; a constant map is all blue
    colour = turbo_colormap(resize(scaled[None, None], size, "bilinear")[0, 0])  # float: no rounding
    if picture is None:
        return to_pil(colour)
    blended = (1 - opacity) * picture.to(colour.device) + opacity * colour.float()
    return to_pil(blended.round().clamp(0, 255).to(torch.uint8))
