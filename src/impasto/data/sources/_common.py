"""What more than one source needs: an image's size from its header."""

from __future__ import annotations

import io

from PIL import Image

from impasto.data.transforms import IMAGE_LOAD_ERRORS


def _image_size(image_file: bytes | str) -> tuple[int, int] | None:
    """``(height, width)`` from the header of encoded image bytes or an image file (pixels are
    not decoded); None when unreadable: the loader reports bad images when it reads them."""
    try:
        with Image.open(
            io.BytesIO(image_file) if isinstance(image_file, bytes) else image_file
        ) as image:
            width, height = image.size
    except IMAGE_LOAD_ERRORS:
        return None
    return height, width
