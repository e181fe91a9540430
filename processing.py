"""Pre- and post-processing for every Sapiens2 task, and the keypoint/class metadata they share with heads.py.

Images in, tensors out; model outputs in, results out (pictures of them: sapiens2_app/predict/pictures.py; COCO files:
sapiens2_app/predict/formats.py). torch + numpy + pillow only, no model code (the default input and patch size are read
from sapiens2.Sapiens2Config, their one home).

Data layout
- An image is a `(3, H, W)` tensor, uint8 (0..255) or float32 (0..255 scale). Sizes are `(height, width)`.
- Boxes are COCO `xywh` in source-image pixels (what HF takes); results report `xyxy`.
- Every step runs on the device of its input (or `device=`); nothing goes back to the CPU except the
  small per-image bookkeeping (sizes, paddings) that lives in Python lists.

Two conventions (docs/checkpoints.md, pre/post-processing of the original). The defaults are the original's,
the one the released weights were trained with, as weights.load's RoPE default (bf16) is; one argument switches
each place to transformers': `resample="hf"` (preprocess, preprocess_crops, crop_people) and `smooth=False`
(postprocess_pointmap), with `weights.load(..., rope_dtype="float32")` for the model.
- `resample="original"` (default): the demo scripts' OpenCV resampling (INTER_AREA / INTER_CUBIC / INTER_LINEAR,
  uint8 warps). OpenCV is not a dependency: these are float versions of OpenCV's kernels and coefficients,
  computed the same on CPU and GPU; they differ from OpenCV's fixed-point arithmetic by at most 1 grey level
  (tests/test_processing.py checks against opencv-python; pose crops against an exact float warp with the
  original's matrix, since OpenCV snaps warp coordinates to 1/32 pixel).
- `resample="hf"`: transformers 5.23 `Sapiens2ImageProcessor`, which resizes with torchvision's antialiased
  bilinear filter and crops people with `grid_sample`. Matched numerically (tests/test_processing.py).
- `smooth=True` (default): the original pointmap demo's Gaussian pre-smoothing before upsampling; HF has none.
- Where HF is silent (flip-back of heatmaps), the original demos are followed and the docstring says so.
  `postprocess_normals` renormalises after the resize, which neither does (`renormalize=False` to match both).

Metadata (names, skeleton, colours, flip pairs, palette, class weights) is read from `data/keypoints308.json` and
`data/seg29.json` (installed as sapiens2/data/).
"""

from __future__ import annotations

if __name__ == "processing":  # a bare `import processing` in a checkout gives the one module, sapiens2.processing
    __import__("sapiens2").one_module(__name__)

import contextlib
import json
import platform
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

from sapiens2 import Sapiens2Config  # (only its defaults: the input and patch size live there)

MODEL_SIZE = Sapiens2Config.image_size  # (height, width) the released checkpoints were trained at
PATCH_SIZE = Sapiens2Config.patch_size
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_PADDING = 1.25  # box enlargement of the top-down pose pipeline (PoseGetBBoxCenterScale)
HEATMAP_DOWNSCALE = 4  # pose heatmaps are 1/4 of the input: 256x192 for 1024x768
HEATMAP_SIGMA = 6.0
DARK_BLUR_KERNEL = 11  # cv2.GaussianBlur(k=11, sigma=0) in the original UDP decoder


# ----------------------------------------------------------------------------------------------------------------
# Metadata: keypoints and classes (stored once, in data/*.json), and the flip mapping of mirrored heatmaps
# ----------------------------------------------------------------------------------------------------------------
DATA_FILES = ("keypoints308.json", "seg29.json", "openpose.json", "coco_wholebody133.json")
DATA_DIR = Path(__file__).resolve().parent / "data"  # beside this file: data/ in a checkout, sapiens2/data installed


class MissingDataError(RuntimeError):
    """A data file of the package is missing or unreadable: the installation is incomplete."""


def read_data(name: str) -> dict:
    path = DATA_DIR / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise MissingDataError(
            f"sapiens2's data file {path} cannot be read ({type(error).__name__}: {error}): the installation is "
            f"incomplete; reinstall it (pip install --force-reinstall PATH_TO_THE_CHECKOUT) or run from the checkout"
        ) from None


def check_data_files():
    """Read every data file now, so that a broken installation stops a command before any model loads."""
    for name in DATA_FILES:
        read_data(name)


@lru_cache(maxsize=None)
def keypoint_metadata() -> dict:
    """The 308 keypoints: names, RGB colours, skeleton, flip indices/pairs, COCO-WholeBody mapping."""
    return read_data("keypoints308.json")


@lru_cache(maxsize=None)
def segmentation_metadata() -> dict:
    """The 29 body-part classes: names, RGB palette, training class weights."""
    return read_data("seg29.json")


def flip_pairs(device=None) -> torch.Tensor:
    """(146, 2) left/right keypoint pairs of the 308 (the other 16 keypoints are their own mirror)."""
    return torch.tensor(keypoint_metadata()["flip_pairs"], device=device)


def flip_heatmaps_back(heatmaps: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Heatmaps of a mirrored image -> heatmaps of the image: swap left/right channels, mirror x.
    No half-pixel shift is needed with UDP heatmaps. `pairs` (P, 2) defaults to the 308-keypoint pairs."""
    pairs = flip_pairs(heatmaps.device) if pairs is None else torch.as_tensor(pairs, device=heatmaps.device)
    order = torch.arange(heatmaps.shape[1], device=heatmaps.device)
    if pairs.numel() and int(pairs.max()) >= heatmaps.shape[1]:
        raise ValueError(f"flip pairs index keypoint {int(pairs.max())}, heatmaps have {heatmaps.shape[1]} channels")
    order[pairs[:, 0]], order[pairs[:, 1]] = pairs[:, 1], pairs[:, 0]
    return heatmaps[:, order].flip(-1)


@lru_cache(maxsize=None)
def coco17_indices() -> tuple[int, ...]:
    """Indices into the 308 keypoints of the 17 COCO body keypoints, in COCO order (wrists are 62 and 41)."""
    mapping = dict(keypoint_metadata()["coco_wholebody_to_keypoints308"])
    return tuple(mapping[i] for i in range(17))


def coco17_names() -> tuple[str, ...]:
    """COCO's 17 body keypoint names in COCO order (nose, left_eye, ...), as the 308 set spells them."""
    return tuple(keypoint_metadata()["keypoint_names"][k] for k in coco17_indices())


# ----------------------------------------------------------------------------------------------------------------
# Loading images
# ----------------------------------------------------------------------------------------------------------------
class ImageLoadError(ValueError):
    """A file could not be read as an image. The message names the file and the reason."""


# The default pixel budget of one image file, width x height, checked from its header before anything decodes it
# (predict.py --max-megapixels, serve.py's upload limit). 40 megapixels holds any camera photo of 2024 (a 7952 x 5304
# full-frame sensor is 42 MP: refused; 36 MP and below pass). Above it, a few hundred bytes of TIFF or WebP can
# declare 130 MP and take 3 GB and half a minute to decode, and one image's full-size results (a normal map in
# float32 is 12 bytes a pixel) grow past 0.5 GB. Pillow itself only refuses above 2 x 89 MP.
PIXEL_BUDGET = 40_000_000


def load_image(image, max_pixels: int | None = None) -> torch.Tensor:
    """Any single image -> `(3, H, W)` RGB tensor, uint8 (or float32 on a 0..255 scale for float arrays/tensors).

    Accepts a path (str/Path), a PIL image, a numpy array `(H, W)`, `(H, W, C)` or a tensor `(H, W)`, `(C, H, W)`
    with C in {1, 3, 4}. Grayscale is repeated, alpha is composited over white (as HF does), palette / CMYK /
    16-bit / float images are converted, and the EXIF orientation is applied. uint16 data and float files (TIFF
    mode F, in [0, 1]) come out as 8 bits, like every other file. Float arrays/tensors must be in [0, 1] (the
    PIL/torchvision convention); pass uint8 for 0..255 data. NaN or infinite values are refused. Tensors keep
    their device. `max_pixels`: a file whose header declares more pixels is refused before it is decoded (None:
    Pillow's own limit only).
    """
    if isinstance(image, (str, Path)):
        path = Path(image)
        opened = _open_image_file(path, max_pixels)
        with decoding(path):  # the conversions decode too (a palette, CMYK, a 16-bit mode)
            return _pil_to_tensor(opened)
    if isinstance(image, Image.Image):
        return _pil_to_tensor(image)
    if isinstance(image, np.ndarray):
        if image.ndim == 3 and image.shape[-1] in (1, 3, 4):
            image = np.ascontiguousarray(image.transpose(2, 0, 1))  # (C, H, W)
        return _tensor_to_rgb(torch.from_numpy(np.ascontiguousarray(image)), "numpy array")
    if isinstance(image, torch.Tensor):
        return _tensor_to_rgb(image, "tensor")
    raise TypeError(f"cannot read an image from a {type(image).__name__}; pass a path, PIL image, array or tensor")


def load_images(images) -> list[torch.Tensor]:
    """A batch -> list of `(3, H, W)` tensors. A batch is a list/tuple, a `(B, C, H, W)` tensor or a
    `(B, H, W, C)` array; anything else is a single image."""
    if isinstance(images, (list, tuple)):
        if len(images) == 0:
            raise ValueError("empty batch: no images given")
        return [load_image(image) for image in images]
    if isinstance(images, (torch.Tensor, np.ndarray)) and images.ndim == 4:
        return [load_image(image) for image in images]
    return [load_image(images)]


def check_image_file(path: Path, max_pixels: int | None = None):
    """The cheap part of reading an image file, its header only (no pixels decoded): it exists, can be opened,
    is not empty, Pillow recognises it and it declares at most `max_pixels` pixels. Raises what load_image would
    (predict.py checks inputs with it before loading a model)."""
    with _open_image_header(path, max_pixels):
        pass


@contextlib.contextmanager
def decoding(source: str | Path):
    """Around the decoding of one user's file (`source` names it: a path, or a video frame): whatever the decoder
    raises comes out as an ImageLoadError naming the file and what is wrong (image_load_error), so that every
    caller catches that one class and one bad file cannot stop the others.

    Exception, not BaseException: Ctrl-C, SystemExit and the like are the process's and pass through. A decoder is
    a large body of C code fed bytes from anywhere, and what it raises on a crafted file is open-ended (Pillow's
    plugins leak struct.error, IndexError, ZeroDivisionError; PyAV its own classes). MemoryError is taken too,
    deliberately: raised here, it is the one large allocation this file's header asked for that was refused, freed
    as the error unwinds, so the next file has the memory it had; a process that truly runs out of memory on Linux
    meets the OOM killer's SIGKILL, not an exception."""
    try:
        yield
    except ImageLoadError:
        raise
    except Exception as error:  # noqa: BLE001 (see above)
        raise image_load_error(source, error) from error


def image_load_error(source: str | Path, error: Exception) -> ImageLoadError:
    """What a decoder raised on `source`, said for the user: which file, what is wrong with it."""
    if isinstance(error, Image.DecompressionBombError):
        size = _declared_size(Path(source)) if isinstance(source, Path) else None
        declared = f"declares {size[0]}x{size[1]} pixels" if size else f"is too large ({error})"
        return ImageLoadError(f"{source}: {declared}, over Pillow's limit of {2 * Image.MAX_IMAGE_PIXELS} pixels: "
                              f"refused as a possible decompression bomb (downscale it to use it)")
    if isinstance(error, UnidentifiedImageError):
        return ImageLoadError(f"{source}: not an image (Pillow does not recognise the format)")
    if isinstance(error, OSError) and error.errno:  # not "corrupt": the file may be fine, only not ours to read
        return ImageLoadError(f"{source}: cannot read it ({error.strerror or error})")
    if isinstance(error, (OSError, SyntaxError, EOFError, ValueError)):  # how Pillow says the data is broken
        return ImageLoadError(f"{source}: truncated or corrupt image ({error})")
    if isinstance(error, MemoryError):
        return ImageLoadError(f"{source}: too large to decode in the memory left (MemoryError)")
    return ImageLoadError(f"{source}: cannot decode it ({type(error).__name__}: {error})")


def _declared_size(path: Path) -> tuple[int, int] | None:
    """The (width, height) a file's header declares, for the message of a refused decompression bomb: Image.open
    refuses it before it returns the image, so the header is read here by the Pillow plugin that accepts the file
    (Image.register_open's registry, as Image.open tries them). None when none reads it."""
    Image.init()
    try:
        with open(path, "rb") as file:
            prefix = file.read(16)
            for format_id in Image.ID:
                factory, accept = Image.OPEN[format_id]
                accepted = accept is None or accept(prefix)
                if not accepted or isinstance(accepted, str):  # (a str: Pillow's warning, not an acceptance)
                    continue
                file.seek(0)
                with contextlib.suppress(Exception):  # (as Image.open: a plugin that fails is not the file's)
                    return factory(file, str(path)).size
    except OSError:
        pass
    return None


def _open_image_header(path: Path, max_pixels: int | None = None) -> Image.Image:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise ImageLoadError(f"{path}: is a directory, not an image file")
    if path.stat().st_size == 0:
        raise ImageLoadError(f"{path}: the file is empty")
    with decoding(path), warnings.catch_warnings():
        if max_pixels is not None:  # the budget below says it (Pillow's warning would add a second message)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(path)
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        image.close()
        raise ImageLoadError(f"{path}: declares {width}x{height} pixels ({width * height / 1e6:.1f} megapixels), over "
                             f"the budget of {max_pixels / 1e6:g} megapixels: refused before decoding (downscale it, "
                             f"or raise the budget)")
    return image


def _open_image_file(path: Path, max_pixels: int | None = None) -> Image.Image:
    with _open_image_header(path, max_pixels) as image, decoding(path):
        image.load()  # decode now, so a truncated file fails here and not somewhere downstream
        return ImageOps.exif_transpose(image)


def _pil_to_tensor(image: Image.Image) -> torch.Tensor:
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):  # 16-bit PNG/TIFF: scale, do not clip at 255
        return _tensor_to_rgb(torch.from_numpy(np.array(image).astype(np.int32)).clamp(0, 65535), "16-bit image")
    if image.mode == "F":  # a float TIFF: [0, 1] like float arrays, then 8 bits like every other file
        return float_to_uint8(_tensor_to_rgb(torch.from_numpy(np.array(image)), "float image") / 255)
    if "A" in image.getbands() or "transparency" in image.info:
        # Same as HF's convert_to_rgb: composite over white, so transparent areas do not become black.
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    rgb = np.array(image.convert("RGB"))  # handles L, 1, P, CMYK, YCbCr, ...
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


def _tensor_to_rgb(image: torch.Tensor, what: str) -> torch.Tensor:
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3 or image.shape[0] not in (1, 3, 4):
        raise ValueError(f"{what} of shape {tuple(image.shape)} is not an image; expected (H, W), (C, H, W) tensors "
                         f"or (H, W, C) arrays with C in 1, 3, 4")
    if image.shape[-1] == 0 or image.shape[-2] == 0:
        raise ValueError(f"{what} of shape {tuple(image.shape)} is empty")
    image = _to_8bit_scale(image, what)
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    elif image.shape[0] == 4:
        image = _composite_over_white(image)
    return image.contiguous()


def _composite_over_white(rgba: torch.Tensor) -> torch.Tensor:
    """Alpha over white in [0, 1], converted back like HF's tensor `convert_to_rgb` (uint8: x * 255.999, floor)."""
    rgb, alpha = rgba[:3].float() / 255, rgba[3:].float() / 255
    composite = rgb * alpha + (1 - alpha)
    return float_to_uint8(composite) if rgba.dtype == torch.uint8 else composite * 255


def _to_8bit_scale(image: torch.Tensor, what: str) -> torch.Tensor:
    if image.dtype == torch.uint8:
        return image
    if image.is_floating_point():
        if not bool(torch.isfinite(image).all()):  # (NaN defeats the range check below: every comparison is False)
            raise ValueError(f"float {what} has NaN or infinite values; float images must be in [0, 1]")
        low, high = image.min().item(), image.max().item()
        if low < 0 or high > 1:
            raise ValueError(f"float {what} has values in [{low:g}, {high:g}]; float images must be in [0, 1] "
                             f"(pass uint8 for 0..255 data)")
        return image.float() * 255
    if image.dtype in (torch.int16, torch.int32, torch.int64, torch.uint16):
        # 16-bit data -> 8 bit with rounding: v8 = round(v16 * 255 / 65535)
        return ((image.long().clamp(0, 65535) * 255 + 32767) // 65535).to(torch.uint8)
    raise ValueError(f"{what} has unsupported dtype {image.dtype}")


# ----------------------------------------------------------------------------------------------------------------
# Resampling primitives
# ----------------------------------------------------------------------------------------------------------------
def resize(images: torch.Tensor, size: tuple[int, int], method: str = "bilinear_antialias") -> torch.Tensor:
    """Resize `(..., C, H, W)` to `size`, keeping the dtype (uint8 results are rounded and saturated).

    Methods:
    - "bilinear_antialias": torchvision's `resize(antialias=True)`, HF's resampling. Reproduces its dtype rules:
      uint8 goes through torch's native uint8 kernel on CPUs where torchvision uses it, else float + round.
    - "bilinear": cv2.INTER_LINEAR (no antialiasing), "bicubic": cv2.INTER_CUBIC (a = -0.75, replicated border),
      "area": cv2.INTER_AREA (exact pixel-overlap averaging when both sides shrink; when one grows, OpenCV's
      two-tap "area mode" linear weights on both axes), "nearest": floor mapping like cv2.INTER_NEAREST.
      These compute OpenCV's coefficients in float (uint8 results rounded once): within 1 grey level of OpenCV.
    """
    height, width = size
    if tuple(images.shape[-2:]) == (height, width):
        return images  # torchvision returns the input untouched in this case too
    shape = images.shape
    batch = images.reshape(-1, *shape[-3:])
    if method == "area" and (height <= shape[-2] and width <= shape[-1]):
        out = _resize_area(batch, size)
    elif method == "area":
        out = _resize_area_mode_linear(batch, size)
    else:
        mode = {"bilinear_antialias": "bilinear", "area": "bilinear"}.get(method, method)
        if mode not in ("bilinear", "bicubic", "nearest"):
            raise ValueError(f"unknown resize method {method!r}")
        antialias = method == "bilinear_antialias"
        out = _interpolate_keep_dtype(batch, size, mode, antialias)
    return out.reshape(*shape[:-2], height, width)


def _interpolate_keep_dtype(images, size, mode, antialias):
    # torch's CPU uint8 kernels round and saturate between the two passes (bicubic: up to 24 grey levels from
    # OpenCV, and CPU != CUDA): only HF's antialiased bilinear takes them, as torchvision does.
    native_uint8 = images.dtype == torch.uint8 and (mode == "nearest" or (
        antialias and images.device.type == "cpu" and _cpu_has_native_uint8_kernel(mode)))
    align = None if mode == "nearest" else False
    if native_uint8 or images.is_floating_point():
        return F.interpolate(images, size=size, mode=mode, align_corners=align, antialias=antialias)
    out = F.interpolate(images.float(), size=size, mode=mode, align_corners=align, antialias=antialias)
    if images.dtype == torch.uint8:
        out = out.clamp_(0, 255)  # bicubic overshoots; torchvision clamps uint8 the same way
    return out.round_().to(images.dtype)


def _cpu_has_native_uint8_kernel(mode: str) -> bool:
    # Mirrors torchvision 0.29 `_do_native_uint8_resize_on_cpu`: torch's uint8 kernel (fixed-point, rounds
    # differently from float + round) is used for bilinear only on AVX2/AVX512/ARM CPUs.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


def _resize_area(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """cv2.INTER_AREA downscaling: each output pixel is the average of the input area it covers."""
    rows = _area_weights(images.shape[-2], size[0], images.device)  # (out_h, in_h)
    cols = _area_weights(images.shape[-1], size[1], images.device)  # (out_w, in_w)
    out = torch.einsum("oh,bchw,pw->bcop", rows, images.float(), cols)
    return out.round_().clamp_(0, 255).to(torch.uint8) if images.dtype == torch.uint8 else out


def _resize_area_mode_linear(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """cv2.INTER_AREA when a side grows: OpenCV's linear resize with its "area mode" two-tap weights, on both
    axes (sx = floor(d * scale), weight of sx + 1 = frac((d + 1) - (sx + 1) / scale) or 0)."""
    out = images.float()
    for axis, (in_size, out_size) in ((-2, (images.shape[-2], size[0])), (-1, (images.shape[-1], size[1]))):
        first, weight = _area_mode_taps(in_size, out_size, images.device)
        second = (first + 1).clamp(max=in_size - 1)
        shape = [1] * out.dim()
        shape[axis] = out_size
        weight = weight.view(shape)
        out = out.index_select(axis, first) * (1 - weight) + out.index_select(axis, second) * weight
    return out.round_().clamp_(0, 255).to(torch.uint8) if images.dtype == torch.uint8 else out


def _area_mode_taps(in_size: int, out_size: int, device):
    """OpenCV resize.cpp, area_mode branch: first tap and the second tap's weight per output pixel."""
    inv_scale = out_size / in_size
    d = torch.arange(out_size, dtype=torch.float64)
    first = torch.floor(d * (1.0 / inv_scale))
    frac = ((d + 1) - (first + 1) * inv_scale).float()
    weight = torch.where(frac <= 0, torch.zeros_like(frac), frac - torch.floor(frac))
    at_edge = first >= in_size - 1  # OpenCV: past the last pixel, replicate it with weight 0
    weight[at_edge] = 0
    first = first.clamp(0, in_size - 1).long()
    return first.to(device), weight.to(device)


def _area_weights(in_size: int, out_size: int, device) -> torch.Tensor:
    scale = in_size / out_size
    starts = torch.arange(out_size, dtype=torch.float64, device=device)[:, None] * scale  # (out, 1)
    pixel = torch.arange(in_size, dtype=torch.float64, device=device)[None, :]  # (1, in)
    overlap = (torch.minimum(pixel + 1, starts + scale) - torch.maximum(pixel, starts)).clamp(min=0)
    return (overlap / scale).float()


def gaussian_kernel1d(kernel_size: int, sigma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """Normalised 1-D Gaussian taps at integer offsets (torchvision's and cv2's kernel for an explicit sigma),
    computed in `dtype`."""
    offsets = torch.arange(kernel_size, dtype=dtype, device=device) - (kernel_size - 1) / 2
    taps = torch.exp(-0.5 * (offsets / sigma) ** 2)
    return taps / taps.sum()


def gaussian_blur(maps: torch.Tensor, kernel_size: int, sigma: float, padding: str = "zeros") -> torch.Tensor:
    """Separable Gaussian blur of `(N, C, H, W)` float maps, each channel on its own.

    `padding="zeros"` is the DARK decoder's pad-with-zeros-then-crop; "reflect" is torchvision's
    `gaussian_blur` (used for the original pointmap smoothing).
    """
    if kernel_size % 2 == 0 or kernel_size <= 1:
        raise ValueError(f"Gaussian kernel size must be odd and > 1, got {kernel_size}")
    channels, half = maps.shape[1], kernel_size // 2
    taps = gaussian_kernel1d(kernel_size, sigma, maps.device, torch.promote_types(maps.dtype, torch.float32))
    taps = taps.to(maps.dtype)  # computed in float64 for float64 maps, else in fp32
    pad_mode = "constant" if padding == "zeros" else padding
    out = F.pad(maps, (half, half, half, half), mode=pad_mode)
    out = F.conv2d(out, taps.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)  # along W
    return F.conv2d(out, taps.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)  # along H


def normalize(images: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """`(..., 3, H, W)` on a 0..255 scale -> float32 `(x - 255 mean) / (255 std)`, as HF's fused rescale+normalize."""
    mean_255 = torch.tensor(mean, dtype=torch.float32, device=images.device).view(3, 1, 1) * 255.0
    std_255 = torch.tensor(std, dtype=torch.float32, device=images.device).view(3, 1, 1) * 255.0
    return (images.float() - mean_255) / std_255


# ----------------------------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ModelInputs:
    """A preprocessed batch and what post-processing needs to map outputs back to the source images.

    pixel_values: `(B, 3, H, W)` float32, normalised (None for `ModelInputs.layout`).
    image_sizes: `(height, width)` of the source image of each row.
    content_boxes: `(top, left, bottom, right)` of the image inside each row (the rest is padding).
    model_size: `(H, W)` of the model input.
    boxes / image_indices / num_images: for person crops, the `(B, 4)` xywh box of each crop, which image it came
    from, and how many images there were (some may have no people).
    """

    pixel_values: torch.Tensor | None
    image_sizes: list[tuple[int, int]]
    content_boxes: list[tuple[int, int, int, int]]
    model_size: tuple[int, int]
    boxes: torch.Tensor | None = None
    image_indices: list[int] | None = None
    num_images: int | None = None

    @classmethod
    def layout(cls, image_sizes, size: tuple[int, int] = MODEL_SIZE, pad: bool = False) -> "ModelInputs":
        """The bookkeeping `preprocess` would record for images of `image_sizes`, without pixels: for
        post-processing outputs whose inputs were prepared elsewhere (HF's `source_sizes`)."""
        sizes = [tuple(int(v) for v in s) for s in image_sizes]
        content = [resized_content_box(s, size) if pad else (0, 0, *size) for s in sizes]
        return cls(None, sizes, content, tuple(size))


def preprocess(images, size: tuple[int, int] = MODEL_SIZE, pad: bool = False, resample: str = "original",
               device=None, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> ModelInputs:
    """Images -> model input.

    `pad=False`: plain resize to `size` ignoring the aspect ratio (HF default; original seg demo).
    `pad=True`: aspect-preserving resize (`int()` of the scaled sides) then centred zero padding in raw pixel
    space (so padding normalises to -mean/std): HF `do_pad=True`, original normal/pointmap/albedo demos.
    `resample`: "original" (default, as the weights were trained; seg: INTER_AREA when the width shrinks else
    INTER_CUBIC; padded tasks: INTER_LINEAR) or "hf" (transformers': antialiased bilinear).
    """
    _check_model_size(size)
    # non_blocking: from pinned memory (predict.py pins decoded images for a GPU) the copy does not wait for the CPU
    images = [image.to(device, non_blocking=True) if device is not None else image for image in load_images(images)]
    resized, content_boxes = [None] * len(images), [None] * len(images)
    for indices in _group_by_shape(images):  # one resize call per distinct input shape, as HF does
        batch = torch.stack([images[i] for i in indices])
        if pad:
            batch, content = _resize_and_pad(batch, size, resample)
        else:
            batch, content = resize(batch, size, _plain_resize_method(batch, size, resample)), (0, 0, *size)
        for row, i in enumerate(indices):
            resized[i], content_boxes[i] = batch[row], content
    pixel_values = normalize(torch.stack([image.float() for image in resized]), mean, std)
    return ModelInputs(pixel_values, [tuple(image.shape[-2:]) for image in images], content_boxes, tuple(size))


def _group_by_shape(images: list[torch.Tensor]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for index, image in enumerate(images):
        groups.setdefault((tuple(image.shape), image.dtype, image.device), []).append(index)
    return list(groups.values())


def resized_content_box(image_size: tuple[int, int], size: tuple[int, int] = MODEL_SIZE):
    """Where an image of `image_size` lands inside the padded model input: `(top, left, bottom, right)`.

    Scale = min(H/h, W/w), sides truncated with `int()`; padding split `pad // 2` before, the rest after
    (same in HF's `center_crop` padding and the original `NormalResizePadImage`).
    """
    scale = min(size[0] / image_size[0], size[1] / image_size[1])
    # at least 1 pixel: a 3x2000 image would otherwise shrink to a 0-pixel side
    new_height, new_width = max(1, int(image_size[0] * scale)), max(1, int(image_size[1] * scale))
    top, left = (size[0] - new_height) // 2, (size[1] - new_width) // 2
    return top, left, top + new_height, left + new_width


def _resize_and_pad(image, size, resample):
    top, left, bottom, right = resized_content_box(tuple(image.shape[-2:]), size)
    method = "bilinear_antialias" if resample == "hf" else _original_method("bilinear", resample)
    image = resize(image, (bottom - top, right - left), method)
    image = F.pad(image, (left, size[1] - right, top, size[0] - bottom), value=0)
    return image, (top, left, bottom, right)


def _plain_resize_method(image, size, resample):
    if resample == "hf":
        return "bilinear_antialias"
    # Original SegResize decides on the width only: INTER_AREA when shrinking, else INTER_CUBIC.
    return _original_method("area" if size[1] < image.shape[-1] else "bicubic", resample)


def _original_method(method, resample):
    if resample != "original":
        raise ValueError(f"resample must be 'hf' or 'original', got {resample!r}")
    return method


def _check_model_size(size):
    if len(size) != 2 or any(int(side) != side or side <= 0 or side % PATCH_SIZE for side in size):
        raise ValueError(f"model input size {size} must be (height, width), both positive multiples of {PATCH_SIZE}")


# --- top-down person crops --------------------------------------------------------------------------------------
def crop_geometry(boxes_xywh: torch.Tensor, size: tuple[int, int] = MODEL_SIZE, padding: float = CROP_PADDING):
    """Boxes `(N, 4)` xywh -> crop centres `(N, 2)` and crop sizes `(N, 2)` (w, h) in image pixels.

    The box is enlarged by `padding`, then its short side is grown until w / h equals the model's aspect
    (PoseGetBBoxCenterScale + the aspect fix of PoseTopdownAffine; HF `boxes_to_crop_params`).
    """
    x, y, w, h = boxes_xywh.float().unbind(-1)
    center = torch.stack([x + 0.5 * w, y + 0.5 * h], dim=-1)
    w, h = w * padding, h * padding
    aspect = size[1] / size[0]
    crop = torch.where((w > h * aspect)[..., None], torch.stack([w, w / aspect], -1), torch.stack([h * aspect, h], -1))
    return center, crop


def crop_people(image: torch.Tensor, boxes_xywh, size: tuple[int, int] = MODEL_SIZE,
                padding: float = CROP_PADDING, resample: str = "original") -> torch.Tensor:
    """One image, N boxes -> `(N, 3, H, W)` float crops on a 0..255 scale (not normalised).

    UDP geometry (`out = s * (in - center + crop / 2)`, `s = (size - 1) / crop`), sampled with
    `grid_sample(align_corners=True)`, zeros outside: bilinear when the crop shrinks (min(sx, sy) < 1),
    bicubic otherwise. "original" (default) rounds and saturates to uint8 like `cv2.warpAffine` on a uint8 image
    (whose INTER_AREA falls back to INTER_LINEAR); "hf" keeps float values (HF `crop_and_resize`).
    """
    boxes = torch.as_tensor(boxes_xywh, dtype=torch.float32, device=image.device).reshape(-1, 4)
    centers, crops = crop_geometry(boxes, size, padding)
    grids, upscale = _crop_grids(centers, crops, size, tuple(image.shape[-2:]))
    image = image.float()[None]
    out = torch.empty(len(boxes), image.shape[1], *size, device=image.device)
    for mask, mode in ((~upscale, "bilinear"), (upscale, "bicubic")):
        if mask.any():
            out[mask] = F.grid_sample(image.expand(int(mask.sum()), -1, -1, -1), grids[mask], mode=mode,
                                      padding_mode="zeros", align_corners=True)
    if resample == "original":
        out = out.clamp_(0, 255).round_()
    elif resample != "hf":
        raise ValueError(f"resample must be 'hf' or 'original', got {resample!r}")
    return out


def _crop_grids(centers, crops, size, image_size):
    """Sampling grid `(N, H, W, 2)` in grid_sample's [-1, 1] coordinates, and which crops are upscaled."""
    out_height, out_width = size
    crop_width, crop_height = crops.unbind(-1)  # (N,)
    scale_x, scale_y = (out_width - 1) / crop_width, (out_height - 1) / crop_height
    grid_y, grid_x = torch.meshgrid(torch.arange(out_height, dtype=torch.float32, device=crops.device),
                                    torch.arange(out_width, dtype=torch.float32, device=crops.device), indexing="ij")
    # (N, H, W): output pixel -> source pixel (pixel centres at integers)
    in_x = grid_x / scale_x[:, None, None] + centers[:, 0, None, None] - 0.5 * crop_width[:, None, None]
    in_y = grid_y / scale_y[:, None, None] + centers[:, 1, None, None] - 0.5 * crop_height[:, None, None]
    height, width = image_size
    # max(.., 1): a 1-pixel side would divide by zero (NaN crops); align_corners maps any coordinate to that pixel
    grids = torch.stack([2.0 * in_x / max(width - 1, 1) - 1.0, 2.0 * in_y / max(height - 1, 1) - 1.0], dim=-1)
    return grids, torch.minimum(scale_x, scale_y) >= 1.0


def preprocess_crops(images, boxes, size: tuple[int, int] = MODEL_SIZE, padding: float = CROP_PADDING,
                     resample: str = "original", device=None, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> ModelInputs:
    """Images + per-image person boxes (COCO xywh lists, several per image) -> one row per person, cropped by
    `crop_people` (`resample`: "original" by default, "hf" for transformers').

    Without boxes the original demo uses the whole image, box xyxy `[0, 0, W - 1, H - 1]`: pass
    `[[0, 0, W - 1, H - 1]]` for that image.
    """
    _check_model_size(size)
    images = load_images(images)
    if len(boxes) != len(images):
        raise ValueError(f"got {len(images)} images but boxes for {len(boxes)}")
    crops, sizes, image_indices, all_boxes = [], [], [], []
    for index, (image, image_boxes) in enumerate(zip(images, boxes)):
        image = image.to(device, non_blocking=True) if device is not None else image
        image_boxes = torch.as_tensor(image_boxes, dtype=torch.float32, device=image.device).reshape(-1, 4)
        crops.append(crop_people(image, image_boxes, size, padding, resample))
        all_boxes.append(image_boxes)
        sizes += [tuple(image.shape[-2:])] * len(image_boxes)
        image_indices += [index] * len(image_boxes)
    pixel_values = normalize(torch.cat(crops), mean, std)
    return ModelInputs(pixel_values, sizes, [(0, 0, *size)] * len(sizes), tuple(size), torch.cat(all_boxes),
                       image_indices, len(images))


# ----------------------------------------------------------------------------------------------------------------
# Post-processing: dense maps
# ----------------------------------------------------------------------------------------------------------------
def _unpad_and_resize(maps: torch.Tensor, inputs: ModelInputs | None, target_sizes) -> list[torch.Tensor]:
    """Crop each `(C, H, W)` map to its image content and bilinearly resize (align_corners=False, no
    antialiasing) to `target_sizes`, else to the source image size when `inputs` is given, else keep it."""
    count = len(maps)
    content = inputs.content_boxes if inputs is not None else [(0, 0, *maps.shape[-2:])] * count
    sizes = [tuple(s) for s in target_sizes] if target_sizes is not None else (
        inputs.image_sizes if inputs is not None else [tuple(maps.shape[-2:])] * count)
    if len(content) != count or len(sizes) != count:
        raise ValueError(f"{count} maps but {len(content)} preprocessed images and {len(sizes)} target sizes")
    if len(set(content)) == 1 and len(set(sizes)) == 1:  # one batched op for the common case
        top, left, bottom, right = content[0]
        return list(_resize_map(maps[:, :, top:bottom, left:right], sizes[0]))
    return [_resize_map(m[None, :, top:bottom, left:right], s)[0]
            for m, (top, left, bottom, right), s in zip(maps, content, sizes)]


def _resize_map(maps: torch.Tensor, size) -> torch.Tensor:
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps, size=tuple(size), mode="bilinear", align_corners=False, antialias=False)


def postprocess_segmentation(logits: torch.Tensor, inputs: ModelInputs | None = None, target_sizes=None,
                             return_scores: bool = False):
    """Logits `(B, C, H, W)` -> per image `(h, w)` int64 class maps (HF `post_process_semantic_segmentation`).

    Logits are cropped to the content (if padded) and resized bilinearly to `target_sizes` or the source image
    size, then argmax. With `return_scores`, each item is `{"segmentation", "scores"}` where scores are the
    resized logits (HF's `segmentation_scores`).
    """
    resized = _unpad_and_resize(logits, inputs, target_sizes)
    if return_scores:
        return [{"segmentation": class_ids(r), "scores": r} for r in resized]
    return [class_ids(r) for r in resized]


def class_ids(scores: torch.Tensor) -> torch.Tensor:
    """`(C, H, W)` -> `(H, W)` int64, the channel of the maximum: torch.argmax(0)'s result (the first maximum; NaN
    counts as the maximum), through max(0), whose reduction over the outer dimension took a third of argmax's CPU
    time (29 channels of a 1440x1080 photo: 160 ms against 550 on one core)."""
    return scores.max(0).indices


def postprocess_normals(normals: torch.Tensor, inputs: ModelInputs | None = None, target_sizes=None,
                        renormalize: bool = True) -> list[torch.Tensor]:
    """Normals `(B, 3, H, W)` -> per image unit normals `(3, h, w)`.

    L2-normalise (eps 1e-8), remove padding, bilinear resize (HF and original order). Bilinear blending
    shortens vectors, so `renormalize=True` normalises again after the resize (HF and the original do not).
    """
    normals = unit_length(normals.float(), dim=1)
    resized = _unpad_and_resize(normals, inputs, target_sizes)
    return [unit_length(n, dim=0) for n in resized] if renormalize else resized


def unit_length(vectors: torch.Tensor, dim: int, eps: float = 1e-8) -> torch.Tensor:
    """`F.normalize(vectors, p=2, dim=dim, eps=eps)`: vectors / max(|v|, eps), with |v| the square root of the sum
    of squares. torch's vector_norm over a channel dimension of 3 takes 35x longer on a CPU (130 vs 4 ms for 1440x1080
    normals) and rounds differently: the two differ by at most 2 ulp (tests/test_processing.py)."""
    return vectors / vectors.square().sum(dim, keepdim=True).sqrt().clamp_min(eps)


def postprocess_pointmap(pointmaps: torch.Tensor, scales: torch.Tensor | None = None,
                         inputs: ModelInputs | None = None, target_sizes=None, smooth: bool = True) -> list[dict]:
    """Pointmaps `(B, 3, H, W)` + scales `(B, 1)` -> per image `{"pointmap": (3, h, w), "depth": (h, w)}`.

    The network predicts XYZ for a canonical camera (focal 768 px); dividing by the predicted scale
    (= f_canonical / f_actual) gives metric coordinates. Then padding is removed and the map resized
    bilinearly. `smooth=True` (default) is the original demo's pre-smoothing: when upsampling, a 3x3 Gaussian
    (sigma 0.8, reflect border) is applied 4 times before the resize; `smooth=False` is HF's (none). Depth is
    the Z channel.
    """
    if scales is not None:
        pointmaps = pointmaps / scales.reshape(-1, 1, 1, 1)
    if smooth:
        pointmaps = _smooth_before_upsampling(pointmaps, inputs, target_sizes)
    return [{"pointmap": p, "depth": p[2]} for p in _unpad_and_resize(pointmaps, inputs, target_sizes)]


def _smooth_before_upsampling(pointmaps, inputs, target_sizes):
    content = inputs.content_boxes if inputs is not None else [(0, 0, *pointmaps.shape[-2:])] * len(pointmaps)
    sizes = target_sizes or (inputs.image_sizes if inputs is not None else [pointmaps.shape[-2:]] * len(pointmaps))
    out = []
    for pointmap, (top, left, bottom, right), size in zip(pointmaps, content, sizes):
        crop = pointmap[None, :, top:bottom, left:right]
        if size[0] > crop.shape[-2] or size[1] > crop.shape[-1]:
            padding = "reflect" if min(crop.shape[-2:]) > 1 else "replicate"  # a 1-pixel side has nothing to reflect
            for _ in range(4):
                crop = gaussian_blur(crop, 3, 0.8, padding=padding)
        full = pointmap[None].clone()
        full[:, :, top:bottom, left:right] = crop
        out.append(full)
    return torch.cat(out)


def postprocess_albedo(albedo: torch.Tensor, inputs: ModelInputs | None = None, target_sizes=None):
    """Albedo `(B, 3, H, W)` -> per image RGB in [0, 1]: clamp, remove padding, bilinear resize (original demo;
    HF has no albedo model)."""
    return _unpad_and_resize(albedo.clamp(0, 1), inputs, target_sizes)


def postprocess_matting(foregrounds: torch.Tensor, alphas: torch.Tensor, target_sizes=None,
                        background=None) -> list[dict]:
    """Matting outputs -> per image `{"foreground": (3, h, w), "alpha": (1, h, w), "composite": (3, h, w) uint8}`.

    foreground is premultiplied RGB; composite = `foreground + (1 - alpha) * background`, clamped, as uint8 the
    way torchvision converts (x * 255.999, truncated). `background`: an (r, g, b) colour in 0..255, one image
    (any `load_image` input) for all, or a list with one per item; resized bilinearly to the matte.
    Values are clamped to [0, 1] (HF clamps only when it resizes).
    """
    mattes = _unpad_and_resize(torch.cat([foregrounds, alphas], dim=1).float(), None, target_sizes)
    backgrounds = _matting_backgrounds(background, len(mattes), foregrounds.device)
    results = []
    for matte, bg in zip(mattes, backgrounds):
        matte = matte.clamp(0, 1)
        foreground, alpha = matte[:3], matte[3:]
        composite = None
        if bg is not None:
            bg = _resize_map(bg[None], matte.shape[-2:])[0] if bg.ndim == 3 else bg.view(3, 1, 1)
            composite = float_to_uint8((foreground + (1 - alpha) * bg).clamp(0, 1))
        results.append({"foreground": foreground, "alpha": alpha, "composite": composite})
    return results


def _matting_backgrounds(background, count, device):
    if background is None:
        return [None] * count
    if isinstance(background, (tuple, list)) and len(background) == 3 and all(
            isinstance(v, (int, float)) for v in background):
        return [torch.tensor(background, dtype=torch.float32, device=device) / 255] * count
    images = [load_image(b) for b in background] if isinstance(background, list) else [load_image(background)]
    if len(images) not in (1, count):
        raise ValueError(f"{len(images)} backgrounds for {count} mattes; give one or one per matte")
    # uint8 -> [0, 1] as torchvision's to_dtype(scale=True): x * (1 / 255)
    images = [image.to(device).float() * (1.0 / 255) for image in images]
    return images * count if len(images) == 1 else images


def albedo_to_uint8(albedo: torch.Tensor) -> torch.Tensor:
    """Albedo in [0, 1] -> uint8 as the original demo writes it: `(albedo * 255).astype(np.uint8)` (truncated)."""
    return albedo.clamp(0, 1).float().mul(255).to(torch.uint8)


def float_to_uint8(values: torch.Tensor) -> torch.Tensor:
    """[0, 1] floats -> uint8 like torchvision `to_dtype(scale=True)`: multiply by 255.999, truncate."""
    return values.mul(255 + 1.0 - 1e-3).to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# Post-processing: pose
# ----------------------------------------------------------------------------------------------------------------
def decode_heatmaps(heatmaps: torch.Tensor, blur_kernel_size: int = DARK_BLUR_KERNEL):
    """Heatmaps `(N, K, H, W)` -> keypoints `(N, K, 2)` (x, y in heatmap pixels) and scores `(N, K)`.

    Argmax (score = unblurred maximum; location -1 when the score is <= 0, left unrefined), then DARK-UDP
    sub-pixel refinement: blur each map with a Gaussian (zeros outside, sigma from the kernel size as cv2 does),
    rescale to the original maximum, clamp to [1e-3, 50], log, and take one Newton step
    `x -= (H + eps I)^-1 g` with finite differences at the argmax. All people and keypoints at once.

    The step only reads the 3x3 log-values around the argmax, and where none of them is clamped the rescale is
    a constant added to all nine, which the finite differences cancel. So each map's nine blurred values are
    computed alone (11x11 taps each) and the whole map is blurred only where a clamp may act (`_needs_whole_map`):
    the same step, 15 instead of 290 ms per person (308 maps of 256x192) on 2 CPU cores.

    The nine blurred values, their logs and the step are computed in float64 (308 x 9 sums per person, as two
    small matmuls: as fast as the fp32 sums were). The step is ill-conditioned where the Hessian is near
    singular (flat maps, as a random model's): there the fp32 rounding of the blur's sums moves keypoints by
    1e-2 px and more, as in transformers' fp32 decode (a float64 step from fp32 sums is no better). So the
    keypoints are a float64 decode's, rounded to fp32 (`tests/test_processing.py`).
    """
    heatmaps = heatmaps.float()
    num_people, num_keypoints, height, width = heatmaps.shape
    flat = heatmaps.reshape(num_people, num_keypoints, -1)
    scores, index = flat.amax(dim=-1), flat.argmax(dim=-1)
    locations = torch.stack([index % width, index // width], dim=-1)  # (N, K, 2)
    valid = scores > 0
    neighbours = _peak_neighbourhoods(locations, height, width)
    blurred = _blurred_at(heatmaps, neighbours, blur_kernel_size)  # (N, K, 3, 3) float64
    log_values = blurred.clamp_min(torch.finfo(blurred.dtype).tiny).log()
    whole = _needs_whole_map(blurred, scores) & valid  # an invalid map's step is not used
    if whole.any():
        log_values[whole] = _clamped_log_values(heatmaps[whole], blurred[whole], blur_kernel_size)
    offset = _newton_offset(log_values)
    refined = torch.where(valid[..., None], locations - offset, -1.0)
    return refined.float(), scores


def _dark_sigma(kernel_size: int) -> float:
    return 0.3 * ((kernel_size - 1) * 0.5 - 1) + 0.8  # cv2.getGaussianKernel's sigma for sigma=0


def _peak_neighbourhoods(locations: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Flat indices `(N, K, 3, 3)` of the 3x3 pixels around integer `locations` `(N, K, 2)`, [dy + 1, dx + 1],
    clamped into the map (the edge pixel repeats, as replicate padding)."""
    step = torch.arange(-1, 2, device=locations.device)
    x = locations[..., 0].clamp(0, width - 1)[..., None, None] + step.view(1, 3)
    y = locations[..., 1].clamp(0, height - 1)[..., None, None] + step.view(3, 1)
    return y.clamp(0, height - 1) * width + x.clamp(0, width - 1)


def _blurred_at(heatmaps: torch.Tensor, pixels: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """DARK's blur (`gaussian_blur(heatmaps, padding="zeros")`) at the flat indices `pixels` `(N, K, ...)` only,
    in float64: each value the weighted sum of the kernel_size^2 pixels around it (zero outside the map)."""
    num_people, num_keypoints, height, width = heatmaps.shape
    half = kernel_size // 2
    taps = gaussian_kernel1d(kernel_size, _dark_sigma(kernel_size), heatmaps.device, torch.float64)
    step = torch.arange(-half, half + 1, device=heatmaps.device)
    y = (pixels // width)[..., None, None] + step.view(-1, 1)  # (..., k, k)
    x = (pixels % width)[..., None, None] + step.view(1, -1)
    inside = (y >= 0) & (y < height) & (x >= 0) & (x < width)
    index = (y.clamp(0, height - 1) * width + x.clamp(0, width - 1)).flatten(2)
    values = torch.where(inside, heatmaps.flatten(2).gather(2, index).view(inside.shape), 0.0).double()
    return (values @ taps) @ taps  # along x, then y


def _needs_whole_map(blurred: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """Per map `(N, K)`: may the rescale-and-clamp change the step (then the whole map is blurred)?

    The rescale factor is peak / (the blurred map's maximum) >= 1 (positive taps summing to 1 never exceed the
    peak), and every rescaled value stays <= peak. So with peak <= 50 and the nine blurred values >= 1e-3 no clamp
    acts on them. The margins (1e-3 of the bound) are far wider than any rounding of the sums."""
    return (peak > 50.0 * (1 - 1e-3)) | (blurred.flatten(-2).amin(dim=-1) < 1e-3 * (1 + 1e-3))


def _clamped_log_values(maps: torch.Tensor, blurred: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The rescaled, clamped log-values `(M, 3, 3)` of `maps` `(M, H, W)` around their peaks, from their nine
    float64 blurred values `blurred` `(M, 3, 3)`.

    The rescale needs each blurred map's maximum. An fp32 blur of the whole map finds where it lies (a float64
    one costs 5-8x more on a CPU) and its value is summed again in float64 at the fp32 blur's 16 largest pixels:
    the float64 maximum is among them unless 16 pixels lie within the fp32 blur's rounding of it, and then the
    rescale is still as exact as an fp32 one."""
    blurred_maps = gaussian_blur(maps[None], kernel_size, _dark_sigma(kernel_size), padding="zeros").flatten(2)
    candidates = blurred_maps.topk(min(16, blurred_maps.shape[-1]), dim=-1).indices  # (1, M, 16)
    blurred_max = torch.maximum(_blurred_at(maps[None], candidates, kernel_size)[0].amax(dim=-1),
                                blurred.flatten(1).amax(dim=1))  # the nine are blurred values too
    peak = maps.flatten(1).amax(dim=1).double()
    # Keep the original peak height (the clamp depends on it); leave all-non-positive maps alone (HF guard).
    rescale = torch.where(blurred_max > 0, peak / torch.where(blurred_max > 0, blurred_max, 1.0), 1.0)
    return (blurred * rescale[:, None, None]).clamp(1e-3, 50.0).log()


def _blurred_log_heatmaps(heatmaps: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """DARK's log-heatmaps, every map blurred whole (in the maps' dtype), rescaled, clamped: the definition the
    nine-pixel path of `decode_heatmaps` follows."""
    blurred = gaussian_blur(heatmaps, kernel_size, _dark_sigma(kernel_size), padding="zeros")
    original_max = heatmaps.amax(dim=(2, 3), keepdim=True)
    blurred_max = blurred.amax(dim=(2, 3), keepdim=True)
    # Keep the original peak height (the clamp below depends on it); leave all-non-positive maps alone (HF guard).
    rescale = torch.where(blurred_max > 0, original_max / torch.where(blurred_max > 0, blurred_max, 1.0), 1.0)
    return (blurred * rescale).clamp(1e-3, 50.0).log()


DARK_EPS = float(torch.finfo(torch.float32).eps)  # the original's `inv(H + eps I)` adds float32's eps, at any dtype


def _newton_offset(log_values: torch.Tensor) -> torch.Tensor:
    """One Newton step from the log-heatmap's 3x3 values `(N, K, 3, 3)` around each peak -> offset `(N, K, 2)`,
    in the values' dtype."""
    def value(dx: int, dy: int) -> torch.Tensor:  # log-heatmap at (x + dx, y + dy), shape (N, K)
        return log_values[..., dy + 1, dx + 1]

    center = value(0, 0)
    right, left, down, up = value(1, 0), value(-1, 0), value(0, 1), value(0, -1)
    grad_x, grad_y = 0.5 * (right - left), 0.5 * (down - up)
    hess_xx = right - 2 * center + left
    hess_yy = down - 2 * center + up
    hess_xy = 0.5 * (value(1, 1) - right - down + center + center - left - up + value(-1, -1))
    hess_xx, hess_yy = hess_xx + DARK_EPS, hess_yy + DARK_EPS  # regularises flat maps
    determinant = hess_xx * hess_yy - hess_xy * hess_xy
    offset_x = (hess_yy * grad_x - hess_xy * grad_y) / determinant
    offset_y = (-hess_xy * grad_x + hess_xx * grad_y) / determinant
    return torch.stack([offset_x, offset_y], dim=-1)


def apply_affine(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """(N, 2) points through the (3, 3) affine `matrix`, e.g. keypoints from a crop's pixels to the photo's (a
    training sample's to_source map)."""
    return points @ matrix[:2, :2].T + matrix[:2, 2]


def heatmap_to_image_coords(keypoints: torch.Tensor, boxes_xywh: torch.Tensor, heatmap_size: tuple[int, int],
                            size: tuple[int, int] = MODEL_SIZE, padding: float = CROP_PADDING) -> torch.Tensor:
    """Keypoints `(N, K, 2)` in heatmap pixels -> source-image pixels (UDP: the heatmap's corner pixels map
    to the crop's edges): `kp / (W_hm - 1, H_hm - 1) * crop + center - crop / 2`."""
    centers, crops = crop_geometry(boxes_xywh.to(keypoints.device), size, padding)
    extent = torch.tensor([heatmap_size[1] - 1, heatmap_size[0] - 1], dtype=torch.float32, device=keypoints.device)
    return keypoints / extent * crops[:, None] + centers[:, None] - 0.5 * crops[:, None]


def postprocess_pose(heatmaps: torch.Tensor, boxes, heatmaps_of_flipped_input: torch.Tensor | None = None,
                     threshold: float | None = None, size: tuple[int, int] | None = None,
                     target_sizes=None, source_sizes=None,
                     blur_kernel_size: int = DARK_BLUR_KERNEL) -> list[list[dict]]:
    """Heatmaps `(N, K, h, w)` of N person crops -> per image, per person
    `{"keypoints": (k, 2) xy, "scores": (k,), "labels": (k,) keypoint ids, "bbox": (4,) xyxy}` in image pixels.

    boxes: the `ModelInputs` from `preprocess_crops`, or per-image lists of xywh boxes as given to it.
    heatmaps_of_flipped_input: the raw model output for `pixel_values.flip(-1)`; it is flipped back here
    (`flip_heatmaps_back`) and averaged in, as the original demo's flip test. (HF's `outputs_flipped` instead
    expects maps that the model already flipped back.) threshold: keep keypoints with score > threshold.
    size: model input size, only its aspect matters (default: from `ModelInputs`, else 1024x768).
    target_sizes: per image `(height, width)` to rescale keypoints and boxes to (e.g. a display size), from
    `source_sizes` (default: the image sizes recorded in `ModelInputs`).
    """
    boxes_xywh, image_indices, num_images = _flatten_boxes(boxes, heatmaps.device)
    size = size or (boxes.model_size if isinstance(boxes, ModelInputs) else MODEL_SIZE)
    if len(boxes_xywh) != len(heatmaps):
        raise ValueError(f"{len(heatmaps)} heatmaps but {len(boxes_xywh)} boxes")
    if heatmaps_of_flipped_input is not None:
        heatmaps = (heatmaps + flip_heatmaps_back(heatmaps_of_flipped_input)) / 2
    keypoints, scores = decode_heatmaps(heatmaps, blur_kernel_size)
    keypoints = heatmap_to_image_coords(keypoints, boxes_xywh, tuple(heatmaps.shape[-2:]), size)
    x, y, w, h = boxes_xywh.unbind(-1)
    boxes_xyxy = torch.stack([x, y, x + w, y + h], dim=-1)
    if target_sizes is not None:
        per_person = _rescale_factors(boxes, source_sizes, target_sizes, image_indices, heatmaps.device)  # (N, 2)
        keypoints, boxes_xyxy = keypoints * per_person[:, None], boxes_xyxy * per_person.repeat(1, 2)
    labels = torch.arange(heatmaps.shape[1], device=heatmaps.device)
    results = [[] for _ in range(num_images)]
    for person, image_index in enumerate(image_indices):
        keep = scores[person] > threshold if threshold is not None else slice(None)
        results[image_index].append({"keypoints": keypoints[person][keep], "scores": scores[person][keep],
                                     "labels": labels[keep], "bbox": boxes_xyxy[person]})
    return results


def _rescale_factors(boxes, source_sizes, target_sizes, image_indices, device) -> torch.Tensor:
    if source_sizes is None:
        if not isinstance(boxes, ModelInputs):
            raise ValueError("target_sizes needs source_sizes (or ModelInputs, which records them)")
        size_of_image = dict(zip(boxes.image_indices, boxes.image_sizes))
        # an image without people has no recorded size; its factor is never used
        source_sizes = [size_of_image.get(i, tuple(t)) for i, t in enumerate(target_sizes)]
    if len(source_sizes) != len(target_sizes):
        raise ValueError(f"{len(source_sizes)} source sizes but {len(target_sizes)} target sizes")
    per_image = torch.tensor([[tw / sw, th / sh] for (sh, sw), (th, tw) in zip(source_sizes, target_sizes)],
                             dtype=torch.float32, device=device)  # (images, 2) as (x, y) factors
    return per_image[torch.tensor(image_indices, dtype=torch.long, device=device)]


def _flatten_boxes(boxes, device):
    if isinstance(boxes, ModelInputs):
        if boxes.boxes is None:
            raise ValueError("these ModelInputs are not person crops; use preprocess_crops")
        return boxes.boxes.to(device), boxes.image_indices, boxes.num_images
    flat = [box for image_boxes in boxes for box in image_boxes]
    indices = [i for i, image_boxes in enumerate(boxes) for _ in image_boxes]
    return torch.tensor(flat, dtype=torch.float32, device=device).reshape(-1, 4), indices, len(boxes)


# ----------------------------------------------------------------------------------------------------------------
# Post-processing: masks and attention maps (Sapiens2.forward(..., attentions=[block, ...]))
# ----------------------------------------------------------------------------------------------------------------
def foreground_mask(segmentation: torch.Tensor, background_classes: Sequence[int] = (0,)) -> torch.Tensor:
    """`(H, W)` bool mask of pixels whose class is not background (for masking normal/depth maps)."""
    background = torch.tensor(list(background_classes), device=segmentation.device)
    return ~torch.isin(segmentation, background)


def attention_grid(attention: torch.Tensor, grid_size: tuple[int, int], query: int = 0,
                   average_heads: bool = True) -> torch.Tensor:
    """One query token's attention over the patches, as a patch grid, in float32.

    attention: `(..., heads, N, N)` probabilities of one block (`out.attentions[i]`, or one image of it), rows
    queries, columns keys, tokens [CLS, R registers, h*w patches]. grid_size: `(h, w)`, `out.features.shape[-2:]`.
    query: the row, 0 = CLS, 1..R = a register (any token index, negative from the end, works).
    Returns `(..., h, w)`, the mean over heads, or `(..., heads, h, w)` with `average_heads=False`. The keys of
    the prefix tokens are left out, so a map sums to at most 1.
    """
    h, w = grid_size
    num_tokens = attention.shape[-1]
    if attention.dim() < 3 or attention.shape[-2] != num_tokens or h * w > num_tokens:
        raise ValueError(f"attention of shape {tuple(attention.shape)} is not (..., heads, N, N) with N >= "
                         f"{h}*{w} tokens (grid_size {tuple(grid_size)})")
    if not -num_tokens <= query < num_tokens:
        raise IndexError(f"query token {query} does not exist; the attention has {num_tokens} tokens")
    row = attention[..., query, num_tokens - h * w:].float()  # (..., heads, h*w): the patch keys
    return (row.mean(-2) if average_heads else row).unflatten(-1, (h, w))
