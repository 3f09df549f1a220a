"""The reliability suite: power loss, crashes and I/O errors, damage, fuzzing, hostile input.

``bench/reliability.py`` runs it at full size and prints the figures its tests record."""
