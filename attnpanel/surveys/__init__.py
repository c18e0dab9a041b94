"""How heads behave over a whole dataset: the survey's statistics and its zarr store."""
