"""Multi-level checkpointing: save often to a fast node-local level, persist less often by
draining committed local steps, and restore from the best verified copy (see docs/levels.md).
"""
