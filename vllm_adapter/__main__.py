"""``python -m vllm_adapter config ...``: see :mod:`vllm_adapter.cli`."""

from __future__ import annotations

import sys

from vllm_adapter.cli import main

if __name__ == "__main__":
    sys.exit(main())
