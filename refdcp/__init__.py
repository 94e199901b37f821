"""refdcp: a formally specified reference implementation of PyTorch Distributed Checkpoint."""
