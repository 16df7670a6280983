"""Entry point of `ddp-launch` (placeholder until the launcher lands)."""

import sys


def main(argv=None) -> int:
    print("ddp-launch: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
