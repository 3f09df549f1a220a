"""shardkeep's test suite. A package so that ``tests.support`` imports the same way from every test
file, from forked or spawned workers, and from ``examples/`` and ``bench/`` scripts."""
