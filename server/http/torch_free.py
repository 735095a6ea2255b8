"""The HTTP frontend runs no model, so its process keeps torch out (~220 MiB of RSS).

`transformers` imports torch whenever torch is installed (its config module does), yet
tokenizers, chat templates and configs need none of it, and the grammar library is asked
through the engine core (`AsyncEngine.check_grammar`). `keep_torch_out()` marks torch as
absent in this process (`sys.modules["torch"] = None`) before transformers is imported:
transformers then sees no torch, and any other `import torch` here fails loudly instead
of silently adding torch's memory to every API server process.

Only for a process whose engine core runs in another process (`engine_mode="process"`,
the server's default); a test that runs the core in a thread keeps torch.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def keep_torch_out() -> bool:
    """Make `import torch` fail in this process from now on; False (and nothing done)
    when torch or transformers is imported already (transformers would have seen it)."""
    if sys.modules.get("torch", False) is None:
        return True
    loaded = [name for name in ("torch", "transformers") if name in sys.modules]
    if loaded:
        logger.debug("torch stays importable here: %s already imported", ", ".join(loaded))
        return False
    sys.modules["torch"] = None
    # transformers' "PyTorch was not found" advice is expected here: import it quietly.
    previous = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if previous is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = previous
    return True
