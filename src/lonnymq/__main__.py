"""``python -m lonnymq``: the ``lonnymq`` command."""

from lonnymq.cli import main

raise SystemExit(main())
