"""`python -m xpyd.sim.emulator`: `xpyd engine-sim`."""

import sys

from xpyd.sim.emulator.main import main

sys.exit(main())
