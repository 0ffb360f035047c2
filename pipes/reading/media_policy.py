"""Where a shard record's media may come from: its dataset's own location, nowhere else.

A media reference in a record (``"image": "imgs/a.jpg"``, ``"images": ["s3://b/p/a.jpg"]``)
is confined to the **base** of the shard that holds it: the media root (or, without one, the
shard's own directory) for local shards, the shard's bucket + prefix for remote ones.

* a relative reference is joined to the base and must stay under it (``..`` cannot climb out;
  local symlinks are followed, as ``resolve_media_path`` does for JSONL);
* a URL of the shard's own protocol must lie under the base (another bucket is refused);
* ``http(s)://`` is never fetched unless its host is in ``allow_hosts`` (exact names), and a
  cloud metadata or link-local address (``169.254.169.254``, ``metadata.google.internal``,
  ``fd00:ec2::254``) is refused even then, in any spelling a client accepts (decimal, hex or
  octal IPv4, IPv4-mapped / NAT64 IPv6, a trailing-dot name);
* anything else (another protocol, an absolute local path in a remote shard) is refused.

A refused reference raises ``MediaRefusedError`` naming the sample: the materializer's
``on_bad_sample`` policy counts it like any bad sample.

>>> confine_media_ref("imgs/a.jpg", base="s3://bucket/set1", where="sample_id=3")
's3://bucket/set1/imgs/a.jpg'
>>> try:
...     confine_media_ref("s3://other/a.jpg", base="s3://bucket/set1", where="sample_id=3")
... except MediaRefusedError as e:
...     print(str(e)[:73])
sample_id=3: media reference 's3://other/a.jpg' is outside this dataset's
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections.abc import Callable, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from neatpack.pipes.reading._record import RecordError, resolve_media_path
from neatpack.pipes.reading.remote import is_url, split_url

__all__ = ["MediaRefusedError", "confine_media_ref", "confine_record_media"]

METADATA_HOSTS: Final = frozenset(
    {"169.254.169.254", "metadata.google.internal", "metadata", "fd00:ec2::254", "100.100.100.200"}
)
_METADATA_IPS: Final = frozenset(
    ipaddress.ip_address(h) for h in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
_NAT64: Final = ipaddress.ip_network("64:ff9b::/96")
# Keys whose string values are media references wherever they stand; ``path`` / ``url`` only
# inside a media block (``{"type": "image", "url": ...}``, ``image_url: {"url": ...}``, an
# item of ``images``): elsewhere they are provenance metadata, neither read nor fetched.
_MEDIA_KEYS: Final = frozenset(
    {"image", "video", "audio", "images", "videos", "audios", "image_url", "video_url"}
)
_BLOCK_KEYS: Final = frozenset({"path", "url"})
_BLOCK_TYPES: Final = frozenset({"image", "video", "audio", "image_url", "video_url"})
_WEB: Final = ("http", "https")


class MediaRefusedError(RecordError):
    """A record's media reference points outside its dataset's location."""


def _metadata_host(host: str) -> bool:
    """Is ``host`` (a URL's hostname) a cloud metadata or link-local address, in any spelling
    a resolver or HTTP client accepts: a trailing-dot name, ``2852039166`` / ``0xa9fea9fe`` /
    ``0251.0376.0251.0376`` / ``169.254.43518`` (inet_aton forms), ``::ffff:169.254.169.254``
    (IPv4-mapped) and the other IPv6 forms that carry an IPv4 address."""
    name = host.strip("[]").rstrip(".").lower()
    ip = _ip(name)
    if ip is None:
        return name in METADATA_HOSTS
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or _nat64_or_compat(ip)
        if embedded is not None and _metadata_ip(embedded):
            return True
    return _metadata_ip(ip)


def _metadata_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return ip.is_link_local or ip.is_unspecified or ip in _METADATA_IPS


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``name`` spells, as ``inet_aton`` reads IPv4 (1 to 4 parts, each decimal,
    ``0x`` hex or ``0`` octal, the last filling the remaining bytes), or None for a name."""
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        pass
    parts = name.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        base = 16 if part[:2] == "0x" else 8 if len(part) > 1 and part[0] == "0" else 10
        digits = part[2:] if base == 16 else part
        try:
            values.append(int(digits, base) if digits else -1)
        except ValueError:
            return None
    last_bits = 8 * (5 - len(values))
    if min(values) < 0 or values[-1] >= 2**last_bits or any(v > 255 for v in values[:-1]):
        return None
    number = values[-1]
    for i, v in enumerate(values[:-1]):
        number |= v << (24 - 8 * i)
    return ipaddress.IPv4Address(number)


def _nat64_or_compat(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address in the NAT64 prefix ``64:ff9b::/96`` or the old IPv4-compatible
    ``::a.b.c.d`` form, which some stacks still route to the IPv4 host."""
    if ip in _NAT64 or int(ip) >> 32 == 0:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def confine_media_ref(ref: str, *, base: str, where: str, allow_hosts: Sequence[str] = ()) -> str:
    """The reference to read (a URL or a local path), or ``MediaRefusedError``."""
    fix = "move the file under it, or fix the record"
    if ref.startswith("data:"):
        return ref  # inline bytes (pipes/reading/formats.py decodes them): nothing is fetched
    if is_url(ref) or ref.startswith("file://"):
        protocol, rest = split_url(ref)
        if protocol in _WEB:
            host = urlsplit(ref).hostname or ""
            if _metadata_host(host):
                raise MediaRefusedError(
                    f"{where}: media reference {ref!r} names a cloud metadata / link-local "
                    f"address ({host}); refused always, whatever allow_hosts says"
                )
            if host.lower() not in {h.lower() for h in allow_hosts}:
                raise MediaRefusedError(
                    f"{where}: media reference {ref!r} is on host {host!r}, which is not in "
                    f"allow_hosts={list(allow_hosts)}; web media is fetched only from hosts "
                    "you list (allow_hosts=[...]), else give the media inside the dataset"
                )
            return ref
        if is_url(base) and protocol == split_url(base)[0]:
            path = posixpath.normpath(rest)
            root = split_url(base)[1].rstrip("/")
            if path == root or path.startswith(root + "/"):
                return f"{protocol}://{path}"
        raise MediaRefusedError(
            f"{where}: media reference {ref!r} is outside this dataset's location {base!r}; {fix}"
        )
    if is_url(base):
        protocol, root = split_url(base)
        root = root.rstrip("/")
        path = posixpath.normpath(posixpath.join(root, ref))
        if ref.startswith("/") or not path.startswith(root + "/"):
            raise MediaRefusedError(
                f"{where}: media reference {ref!r} is outside this dataset's location "
                f"{base!r} (a local path or one that climbs out of it); {fix}"
            )
        return f"{protocol}://{path}"
    try:
        return resolve_media_path(ref, -1, base)
    except RecordError as e:
        raise MediaRefusedError(f"{where}: {str(e).partition(': ')[2]}") from None


def confine_record_media(
    raw: Any, *, base: str, where: str, allow_hosts: Sequence[str], load: Callable[[str], Any]
) -> Any:
    """``raw`` with every string media reference confined and replaced by
    ``load(confined reference)`` (a lazy image, bytes, or the checked local path). Copy on
    write: ``raw`` itself is never changed, containers along a replaced value are new, the
    rest is shared (a cached Parquet row is read again unchanged).

    Media references are the strings under ``image`` / ``video`` / ``audio`` (and their
    plurals), and ``path`` / ``url`` inside a media block; a ``{"bytes": ..., "path": ...}``
    struct with its bytes is left as it is (the path is only the original file name).

    >>> row = {"images": ["a.jpg"], "messages": [{"content": [{"type": "text", "text": "x"}]}]}
    >>> out = confine_record_media(row, base="s3://b/p", where="s", allow_hosts=(), load=str.upper)
    >>> out["images"], row["images"], out["messages"] is row["messages"]
    (['S3://B/P/A.JPG'], ['a.jpg'], True)
    """

    def ref(value: str) -> Any:
        return load(confine_media_ref(value, base=base, where=where, allow_hosts=allow_hosts))

    return _walk(raw, False, ref)


def _walk(node: Any, media: bool, ref: Callable[[str], Any]) -> Any:
    """A module function, not a nested one: a self-recursive closure is a reference cycle,
    and the length index runs with the garbage collector paused (one leaked per record)."""
    if isinstance(node, str):
        return ref(node) if media else node
    if isinstance(node, dict):
        if node.get("bytes") is not None:
            return node
        block = media or node.get("type") in _BLOCK_TYPES
        changed = {}
        for k, v in node.items():
            if k == "text":
                continue
            new = _walk(v, k in _MEDIA_KEYS or (block and k in _BLOCK_KEYS), ref)
            if new is not v:
                changed[k] = new
        return {**node, **changed} if changed else node
    if isinstance(node, list):
        items = [_walk(item, media, ref) for item in node]
        return items if any(a is not b for a, b in zip(items, node, strict=True)) else node
    return node
