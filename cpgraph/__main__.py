"""``python -m cpgraph``: the ``cpgraph`` command (what ``torchrun ... -m cpgraph launch`` starts in each rank)."""

import sys

from cpgraph.cli import main

sys.exit(main())
