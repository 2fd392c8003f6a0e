"""`python -m xpyd.proxy`: run the proxy without the `xpyd` command."""

from __future__ import annotations

import sys

from xpyd.proxy.main import main

sys.exit(main())
