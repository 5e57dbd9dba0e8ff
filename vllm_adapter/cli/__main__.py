"""``python -m vllm_adapter.cli config ...``: the same as ``python -m vllm_adapter``."""

from __future__ import annotations

import sys

from vllm_adapter.cli import main

if __name__ == "__main__":
    sys.exit(main())
