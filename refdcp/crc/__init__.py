"""The CRC-32C code, below planning and storage: the kernel and the piecewise helper (INTEG-9, INTEG-11)."""
