"""`pagedserve --version` prints the version GET /version and Ollama's /api/version report."""

from __future__ import annotations

import pytest

from server.common.version import package_version
from server.http.cli import main


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedserve {package_version()}"
    assert package_version()[0].isdigit()
