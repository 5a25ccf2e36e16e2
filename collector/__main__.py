"""``python -m steptrace.collector ...`` is ``steptrace collector ...``."""

import sys

from steptrace.collector._cli import main

sys.exit(main())
