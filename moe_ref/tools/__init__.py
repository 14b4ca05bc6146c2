"""Stage 6, the tools on top of the library: ``cli`` (the ``moe-ref`` command) and ``dist_check`` (the torchrun
correctness harness)."""
