"""Reading the files a checkpoint, the registry and the pool catalogue are made of.

The policy server reads these files from folders other people write to (a registry a nightly job
fills, a catalogue mounted from a ConfigMap). A name there may be a FIFO, a device or a link to
one: ``Path.read_bytes`` on a FIFO blocks until someone writes to it, on ``/dev/zero`` it never
ends, and ``stat().st_size`` is 0 for both, so a size check before reading does not catch them
(found by review: a registry's weights file made a FIFO hung the server's poll). :func:`read_bounded`
opens without blocking, refuses anything but a regular file, and never reads past its limit.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

#: the largest JSON document (manifest, registry file, catalogue) read whole
MAX_DOC_BYTES = 16 * 1024 * 1024


def read_bounded(path: str | Path, limit: int = MAX_DOC_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (symbolic links followed), at most ``limit`` of them.

    Raises :class:`FileNotFoundError` as ``open`` does, and :class:`OSError` (``EINVAL``) for
    anything that is not a regular file or (``EFBIG``) for a file longer than ``limit`` bytes.
    """
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file ({stat.filemode(mode)})", str(path))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise OSError(errno.EFBIG, f"larger than the limit of {limit} bytes", str(path))
    finally:
        os.close(fd)
