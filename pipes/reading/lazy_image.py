"""Lazily opened images cross to worker processes encoded, not decoded.

A streaming graph reads its records in the trainer's process (the packer needs each record's
length before the next one) and hands whole records to the workers. A record's image is a
*lazily opened* PIL image (``formats.py``, ``shards.py``: the header is read for the length,
the pixels are not), and PIL pickles an image by its pixels: ``tobytes()`` decodes it first.
Sent as is, every image would be decoded in the trainer's process, not in the workers, and
cross as raw pixels (a 448 x 448 JPEG of 134 KB pickled to 602 KB).

``send_lazy_images_encoded()`` registers, for the pickling of ``multiprocessing`` only (the
queues the worker stage uses; plain ``pickle`` is untouched), a reduction that sends an image
not yet decoded as its encoded bytes and opens it lazily again on the other side: the worker
decodes it, as in the planned graphs. A decoded image still pickles by its pixels.

>>> import io, numpy as np
>>> from multiprocessing.reduction import ForkingPickler
>>> from PIL import Image
>>> buf = io.BytesIO()
>>> Image.fromarray(np.zeros((64, 48, 3), np.uint8)).save(buf, "PNG")
>>> send_lazy_images_encoded()
>>> sent = ForkingPickler.dumps(Image.open(io.BytesIO(buf.getvalue())))
>>> len(sent) < 64 * 48 * 3
True
>>> got = ForkingPickler.loads(sent)  # what a worker's queue does
>>> got.size, got.tile != []  # lazily opened again: decoded where it is used
((48, 64), True)
"""

from __future__ import annotations

import io
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["send_lazy_images_encoded"]

_REGISTERED: set[type] = set()


def _reopen(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _reduce(image: Any) -> Any:
    fp = getattr(image, "fp", None)
    if image.tile and fp is not None:  # opened, not decoded: its file holds the encoded bytes
        try:
            at = fp.tell()
            fp.seek(0)
            data = fp.read()
            fp.seek(at)
            return _reopen, (bytes(data),)
        except (OSError, ValueError):
            pass  # a closed or unseekable file: PIL's own pickling (the pixels)
    return image.__reduce_ex__(2)


def send_lazy_images_encoded() -> None:
    """Register the reduction for every PIL image file class (idempotent)."""
    from PIL import Image, ImageFile

    Image.init()
    for factory, _accept in Image.OPEN.values():
        cls: Any = factory
        if (
            isinstance(cls, type)
            and issubclass(cls, ImageFile.ImageFile)
            and cls not in _REGISTERED
        ):
            ForkingPickler.register(cls, _reduce)
            _REGISTERED.add(cls)
