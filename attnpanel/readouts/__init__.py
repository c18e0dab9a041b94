"""Numbers the views show, read or recomputed from a trace: numpy and xarray, no plotting."""
