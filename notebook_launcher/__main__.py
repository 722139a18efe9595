"""``python -m notebook_launcher``: the ``notebook-launcher`` command."""

from __future__ import annotations

import sys

from notebook_launcher.cli import main

sys.exit(main())
