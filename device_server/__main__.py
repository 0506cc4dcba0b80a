"""``python -m device_server``: see ``device_server.cli``."""

import sys

from device_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
