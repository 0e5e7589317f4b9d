"""One digest over a data source's token files, as the manifest lists them."""

from __future__ import annotations

import hashlib
from pathlib import Path


def files_digest(files: list[dict[str, str]]) -> str:
    """One sha256 over a data source's token files (`data_facts`' "files"): of the listing
    `sha256sum` prints for them, by file name in sorted order."""
    listing = sorted((Path(entry["file"]).name, entry["sha256"]) for entry in files)
    text = "".join(f"{digest}  {name}\n" for name, digest in listing)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
