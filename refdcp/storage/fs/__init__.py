"""The filesystem storage: writer and reader, paths, reads, locks, clean-up, commit mark (STORE-*)."""
