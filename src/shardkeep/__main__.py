"""``python -m shardkeep``: the same program as the ``shardkeep`` command."""

from shardkeep.cli import main

raise SystemExit(main())
