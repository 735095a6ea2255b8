"""`pagedserve serve --chat-template` with a template that does not parse: the server
does not start, and says why in one line naming the template's line."""

from __future__ import annotations

import subprocess
import sys

from tests.support.model_fixtures import build_tiny_checkpoint


def test_a_broken_template_is_a_one_line_start_up_error(tmp_path):
    model_dir = build_tiny_checkpoint(tmp_path, "llama")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    proc = subprocess.run(
        [sys.executable, "-m", "server.http.cli", "serve", "--model", str(model_dir),
         "--chat-template", str(broken), "--port", "0", "--kv-cache-memory", "64M",
         "--log-level", "error"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert f"chat template (--chat-template {broken}) line 2:" in errors[0]
    assert "Traceback" not in proc.stderr
