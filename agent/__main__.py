"""`python -m agent`: the same as the `gpuledger` command."""

from __future__ import annotations

import sys

from agent.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
