"""`python -m finetune` (what torchrun runs): the same CLI."""

import sys

from finetune.cli import main

sys.exit(main())
