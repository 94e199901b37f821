"""The compatibility matrix of real third-party backends (CONF-56): ``make conformance-matrix``."""
