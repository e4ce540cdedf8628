"""``python -m llmgw`` is the ``llmgw`` command."""

import sys

from .cli import main

sys.exit(main())
