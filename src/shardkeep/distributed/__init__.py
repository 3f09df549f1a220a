"""Cross-rank coordination and the commit protocol. Importing this package does not import torch."""
