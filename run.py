"""Entry point: python run.py --config configs/file.yaml (see --help)."""

import sys

from pipeline.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
