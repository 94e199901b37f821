"""The global save metadata and its checks (META-*), over dense integer ids; the rule in ``refdcp/reference/metadata.py``."""
