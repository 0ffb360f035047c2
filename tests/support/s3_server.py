"""moto's standalone S3 server in a subprocess on a free 127.0.0.1 port, for the tests that read
shards from object storage (``tests/pipes/test_remote.py``, the README's example)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from support.gloo_ranks import free_port

# What a user's environment would hold: the README example reads the endpoint from it.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip


@contextmanager
def moto_s3() -> Iterator[str]:
    """The server's endpoint URL while the block runs; the server is stopped after it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **S3_ENV},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec ``storage_options`` for the server at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}  # fmt: skip


def s3_buckets(options: dict[str, Any], *names: str) -> Any:
    """Create the buckets ``names`` on the server of ``options``; an ``s3fs`` file system on it."""
    import boto3
    import s3fs

    client = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    for name in names:
        client.create_bucket(Bucket=name)
    return s3fs.S3FileSystem(skip_instance_cache=True, **options)
