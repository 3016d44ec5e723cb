"""`python -m inference_cli`."""

import sys

from inference_cli.cli import main

sys.exit(main())
