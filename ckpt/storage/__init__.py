"""Where checkpoint bytes go: a local folder or an object store (s3://bucket/prefix, az://container/prefix). The
one place that knows URL schemes: `BACKENDS` maps a scheme to its backend class; every other module asks
`storage_for(path)` and calls its methods (the contract they keep: base.py).

    python -m pytest tests/test_storage_backends.py -q

A new backend: one class (a subclass of base.Storage, in a module of this package), its entry in `BACKENDS`
("module:Class", imported on its scheme's first path; and, if it needs an optional package, in
`OPTIONAL_PACKAGE`), and its entry in tests/test_storage_backends.py. Only the schemes in BACKENDS are known; any
other scheme, or one whose package is not installed, is refused by `unsupported`.
"""

from __future__ import annotations

import functools
import importlib
import re

from .base import Storage
from .local import LocalStorage

# scheme -> its backend class, or "module:Class" in this package for one imported on first use: the object-store
# backends load their SDKs (azure-storage-blob with aiohttp, botocore), ~0.5 s of every process's start that a run
# on a local disk never needs
BACKENDS: dict[str | None, type[Storage] | str] = {
    None: LocalStorage, "s3": ".s3:S3Storage", "az": ".azure:AzureStorage"}
# scheme -> the third-party package its backend needs (pinned in requirements.txt)
OPTIONAL_PACKAGE = {"s3": "s3fs", "az": "azure.storage.blob"}
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def _scheme_of(path: str) -> str | None:
    """The URL scheme of `path` ("s3" for s3://bucket/key), None for a local path. Private to this package: outside
    it, what differs between backends is a method of the backend."""
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def unsupported(path: str, what: str, local_only: str = "") -> str | None:
    """Why `path` (named `what`, e.g. "config key 'ckpt.dir'") cannot be used, or None. `local_only`: this path
    must be local, and why (run.dir, the data cache). A URL is never taken for a local folder named `s3:`."""
    scheme = _scheme_of(path)
    if scheme is None:
        return None
    if local_only:
        return f"{what} must be a local path, got {path!r}: {local_only}"
    if scheme not in BACKENDS:
        return (f"{what}: {scheme}:// is not supported, got {path!r} (object storage: s3://bucket/prefix, "
                "az://container/prefix)")
    if not path[len(scheme) + 3:].strip("/"):
        word = backend(scheme).bucket_word
        return f"{what}: {path!r} names no {word} ({scheme}://{word}/prefix)"
    package = OPTIONAL_PACKAGE.get(scheme)
    try:
        if package:
            importlib.import_module(package)  # optional third-party package, only for this scheme's paths
    except ImportError:
        return (f"{what}={path} needs the {package} package, which is not installed: pip install {package} "
                "(pinned in requirements.txt)")
    return None


def is_url(path: str) -> bool:
    """`path` names a place on a store by URL (scheme://...), not a local path: for config checks that must not
    take a URL for a folder."""
    return _scheme_of(path) is not None


def backend(scheme: str | None) -> type[Storage]:
    """The backend class of `scheme` (a key of BACKENDS), its module imported the first time it is asked for."""
    cls = BACKENDS[scheme]
    if isinstance(cls, str):
        module, name = cls.split(":")
        cls = BACKENDS[scheme] = getattr(importlib.import_module(module, __name__), name)
    return cls


def _backend_of(path: str) -> type[Storage]:
    scheme = _scheme_of(path)
    return backend(scheme if scheme in BACKENDS else None)


def storage_for(path: str) -> Storage:
    """The backend holding `path`."""
    return _backend_of(path)()


@functools.cache
def _reader_with(mixin: type, reader: type) -> type:
    return type(f"{mixin.__name__.lstrip('_')}{reader.__name__}", (mixin, reader), {})


def reader_with(mixin: type, path: str):
    """DCP's reader of `path`'s backend with `mixin` in front (it overrides `load_item` or `read_metadata`): a
    reader variant written once for every backend (export's single copy, resume's verified metadata)."""
    return _reader_with(mixin, storage_for(path).reader_class)(path)


def join(path: str, *names: str) -> str:
    """os.path.join for local paths; '/' for URLs, whatever the OS."""
    return _backend_of(path).join(path, *names)
