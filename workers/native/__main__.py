"""`python -m workers.native`: build the native kernels now (exit 1 if one cannot be)."""

import logging
import sys

from workers.native import decode_attention, fused_ops


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger(__name__).info("building native CPU kernels (about 30 s the first time)")
    built = [decode_attention(), fused_ops()]
    return 0 if all(k is not None for k in built) else 1


if __name__ == "__main__":
    sys.exit(main())
