"""`python -m gpu_check`: the GPU check (check.py)."""

import sys

from gpu_check.check import main

sys.exit(main())
