"""The torch and transformers releases this project supports, and the one check that refuses older ones.

    python -c "from common.versions import unsupported_versions; print(unsupported_versions() or 'supported')"

ckpt/ relies on private parts of torch.distributed.checkpoint (docs/dependencies.md lists each, with the releases
it was checked on), so a torch older than the oldest checked release is refused rather than left to fail inside
DCP mid-save. Newer releases are not refused: requirements.txt pins the newest checked one.
"""

from __future__ import annotations

import importlib.metadata
import re

import torch

# (package, oldest release checked, newest release checked): the suite's named subset ran on both (docs/dependencies.md)
CHECKED = (("torch", "2.11.0", "2.13.0"), ("transformers", "5.17.0", "5.23.0"))


def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string: '2.11.0+cu130' -> (2, 11, 0), '5.17.0.dev0' -> (5, 17, 0)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def installed(package: str) -> str | None:
    """The installed version, read without importing the package (transformers takes seconds to import)."""
    if package == "torch":
        return torch.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def unsupported_versions() -> str | None:
    """Why the installed torch or transformers cannot be used (older than the oldest checked release), or None."""
    for package, oldest, newest in CHECKED:
        have = installed(package)
        if have is not None and release(have) < release(oldest):
            return (f"{package} {have} is older than this project supports ({oldest} to {newest} were checked; "
                    f"docs/dependencies.md): install {package}>={oldest}")
    return None
