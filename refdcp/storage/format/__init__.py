"""How items and files are encoded: item frames, records, tensor values, file names (FMT-*, INTEG-*); no file I/O."""
