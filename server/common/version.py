"""The installed pagedserve's version: `pagedserve --version`, GET /version, /api/version."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0.1.0"
