"""What serve.py reads from a client: a multipart/form-data body, parsed strictly within limits, and each uploaded
photo judged by its content alone (its first bytes and Pillow's reading of its header, never its name or the type
the client claims), with its pixel count bounded (decompression bombs) before anything decodes it.

    parts = parse_multipart(content_type, body)       # [Part(name, filename, data)]; ClientError(400) if malformed
    kind, (width, height) = sniff_image(part.data)    # ClientError(400) for a non-image or a bomb
    safe_name(part.filename, index)                   # a display name; it never reaches the file system

Written for the standard library alone: the `cgi` module is gone from Python 3.13, and `email`'s MIME parser is
lenient by design; only the headers of a part go through `email` (quoting, RFC 2231 names).
"""

from __future__ import annotations

import contextlib
import io
import re
import unicodedata
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from email.policy import HTTP

from PIL import Image

from sapiens2 import processing

MAX_PARTS = 70  # form fields in one upload: MAX_IMAGES photos and a few fields
MAX_IMAGES = 64  # photos in one job
MAX_PART_HEADER_BYTES = 8192
MAX_FIELD_BYTES = 1024  # a text field (tasks=...)
MAX_PIXELS = processing.PIXEL_BUDGET  # pixels of one photo, width x height (why 40 MP: processing.PIXEL_BUDGET)
# A part's Content-Disposition that plainly names the image field, found in its raw bytes when email cannot read them
PLAIN_IMAGE_FIELD = re.compile(
    rb'^content-disposition:[ \t]*form-data[ \t]*;(?:[^\r\n]*;)?[ \t]*name="?image"?[ \t]*(?:;|\r|$)', re.I | re.M)
BOUNDARY = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")  # RFC 2046's bchars, 1..70

# The first bytes of each format Pillow may read here -> Pillow's name for it, which then is the only decoder tried
SIGNATURES = (
    (b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"P5", "PPM"), (b"P6", "PPM"),
)
EXTENSIONS = {"JPEG": ".jpg", "PNG": ".png", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif", "PPM": ".ppm",
              "WEBP": ".webp"}


class ClientError(Exception):
    """A request refused: its HTTP status and the one line the page shows."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class CheckedPhoto:
    """An uploaded photo as judged by check_photo: its data, or why it is refused."""
    name: str  # safe_name
    data: bytes | None  # None: refused
    extension: str = ""  # of the format its content shows (.jpg, .png, ...)
    size: tuple[int, int] = (0, 0)  # width, height, from its header
    error: str | None = None


@dataclass
class Part:
    name: str  # the form field
    filename: str | None  # as the client sent it (only ever shown, never used as a path)
    data: bytes
    header_error: str | None = None  # why an image part's headers could not be read (that photo is refused)


# ----------------------------------------------------------------------------------------------------
# multipart/form-data (RFC 7578)
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def header_parsing(what: str):
    """Around `email`'s reading of a header's parameters, which raises on crafted values (RFC 2231 `a*=` in a
    charset that fails to decode, or a codec such as idna that refuses email's error handler; a NUL in the charset
    name; a parameter `a*` without a value): a 400 naming `what`, never a 500."""
    try:
        yield
    except ClientError:
        raise
    except Exception as error:  # noqa: BLE001 (what the standard library raises on crafted bytes is open-ended)
        raise ClientError(400, f"malformed multipart upload: {what} cannot be read ({type(error).__name__})") from None


def boundary_of(content_type: str) -> bytes:
    """The boundary of a `multipart/form-data; boundary=...` Content-Type, checked against RFC 2046."""
    with header_parsing("the Content-Type header"):
        raw = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")  # (http.server decodes headers as latin-1)
        headers = BytesHeaderParser(policy=HTTP).parsebytes(raw)
        kind = headers.get_content_type()
        boundary = headers.get_param("boundary") if kind == "multipart/form-data" else None
    if kind != "multipart/form-data":
        raise ClientError(415, f"expected a multipart/form-data upload (form fields image and tasks), got {kind[:100]}")
    if not isinstance(boundary, str) or not boundary.isascii() or not BOUNDARY.fullmatch(boundary.encode("ascii")):
        raise ClientError(400, "the multipart upload has no valid boundary")
    return boundary.encode("ascii")


def parse_multipart(content_type: str, body: bytes) -> list[Part]:
    """The parts of a multipart/form-data body, strictly: every part between `--boundary` lines, the closing
    `--boundary--` present, at most MAX_PARTS parts with headers of at most MAX_PART_HEADER_BYTES each."""
    delimiter = b"--" + boundary_of(content_type)
    if not body.startswith(delimiter):
        raise ClientError(400, "malformed multipart upload: it does not start with its boundary")
    parts, position = [], len(delimiter)
    while True:
        if body.startswith(b"--", position):  # the closing delimiter
            return parts
        if not body.startswith(b"\r\n", position):
            raise ClientError(400, "malformed multipart upload: a boundary is not followed by a line break")
        end = body.find(b"\r\n" + delimiter, position + 2)
        if end < 0:
            raise ClientError(400, "malformed multipart upload: it ends before its closing boundary (cut short?)")
        if len(parts) == MAX_PARTS:
            raise ClientError(400, f"too many form fields: at most {MAX_PARTS} in one upload")
        parts.append(parse_part(body[position + 2 : end]))
        position = end + 2 + len(delimiter)


def parse_part(raw: bytes) -> Part:
    """One part: its headers (Content-Disposition: form-data; name=...; filename=...), a blank line, its data."""
    split = raw.find(b"\r\n\r\n")
    if split < 0 or split > MAX_PART_HEADER_BYTES:
        raise ClientError(400, "malformed multipart upload: a part's headers are missing or too long")
    try:
        with header_parsing("a part's headers"):  # (email decodes every parameter to read any one of them)
            headers = BytesHeaderParser(policy=HTTP).parsebytes(raw[: split + 2] + b"\r\n")
            disposition = headers.get_content_disposition()
            name = headers.get_param("name", header="content-disposition")
            filename = headers.get_filename()
    except ClientError as error:
        if PLAIN_IMAGE_FIELD.search(raw[:split]):  # a photo's headers: that photo is refused, the others run
            return Part("image", None, raw[split + 4 :], error.message.removeprefix("malformed multipart upload: "))
        raise
    if disposition != "form-data" or not name or not isinstance(name, str):
        raise ClientError(400, "malformed multipart upload: a part without Content-Disposition: form-data; name=...")
    if filename is not None:  # browsers send ", CR and LF in names as %22, %0D, %0A (the HTML standard's encoding)
        filename = str(filename).replace("%22", '"').replace("%0D", "\r").replace("%0A", "\n")
    return Part(name, filename, raw[split + 4 :])


def text_field(part: Part) -> str:
    if part.filename is not None or len(part.data) > MAX_FIELD_BYTES:
        raise ClientError(400, f"form field {part.name!r}: expected a short text value")
    try:
        return part.data.decode("utf-8")
    except UnicodeDecodeError:
        raise ClientError(400, f"form field {part.name!r}: not UTF-8 text") from None


# ----------------------------------------------------------------------------------------------------
# Photos
# ----------------------------------------------------------------------------------------------------
def sniff_image(data: bytes) -> tuple[str, tuple[int, int]]:
    """(Pillow's format name, (width, height)) of an uploaded photo, from its content: its signature picks the
    one decoder that may read it, whose header gives the size. Raises ValueError (the one line to show) for
    an empty file, a file that is no image of a known kind, a header Pillow cannot read, or more than
    MAX_PIXELS pixels (a decompression bomb: a small file that decodes to gigabytes)."""
    if not data:
        raise ValueError("the file is empty")
    kind = next((name for signature, name in SIGNATURES if data.startswith(signature)), None)
    if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "WEBP"
    if kind is None:
        raise ValueError(f"not an image: expected {', '.join(sorted(EXTENSIONS))} (its first bytes say otherwise)")
    Image.init()
    open_header = Image.OPEN[kind][0]  # the format's reader alone (Image.open would try its bomb check first)
    try:
        with open_header(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception as error:  # noqa: BLE001 (as processing.decoding: what a reader raises on crafted bytes is
        # open-ended, and it is this photo's failure alone; Ctrl-C and SystemExit are BaseExceptions and pass)
        raise ValueError(f"a {kind} file whose header cannot be read ({type(error).__name__}: {error})") from None
    if width * height > MAX_PIXELS:
        raise ValueError(f"refused: {width}x{height} is {width * height / 1e6:.0f} megapixels, over the limit of "
                         f"{MAX_PIXELS / 1e6:.0f} (a decompression bomb, or a photo to scale down first)")
    return kind, (width, height)


def check_photo(part: Part, index: int) -> CheckedPhoto:
    """An `image` field of the upload: a photo to run, or refused with the reason (sniff_image)."""
    name = safe_name(part.filename, index)
    if part.header_error is not None:
        return CheckedPhoto(name, None, error=f"{name}: {part.header_error}")
    try:
        kind, size = sniff_image(part.data)
    except ValueError as error:
        return CheckedPhoto(name, None, error=f"{name}: {error}")
    return CheckedPhoto(name, part.data, EXTENSIONS[kind], size)


def safe_name(filename: str | None, index: int) -> str:
    """What the page and the results call an uploaded photo: the file name the client gave, without any folder,
    control or separator character, at most 100 characters; `image-N.jpg` when nothing is left. It is shown and
    written into pose.json (as predict.py writes the input's name), never used as a path."""
    name = re.split(r"[/\\]", filename or "")[-1]
    name = "".join(c for c in unicodedata.normalize("NFC", name) if unicodedata.category(c)[0] != "C")
    name = name.strip().lstrip(".")[-100:].strip()
    return name or f"image-{index}.jpg"
