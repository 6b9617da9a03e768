"""`python -m workers.runner.native`: build the native kernels now (exit 1 if one cannot be)."""

import logging
import sys

from workers.runner.native import build_all


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger(__name__).info("building native CPU kernels (about 30 s the first time)")
    return 0 if build_all() else 1


if __name__ == "__main__":
    sys.exit(main())
