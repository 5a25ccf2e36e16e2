"""``python -m steptrace ...`` is the ``steptrace`` command."""

import sys

from steptrace._cli import main

sys.exit(main())
