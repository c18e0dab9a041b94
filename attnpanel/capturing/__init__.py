"""Watching any PyTorch model compute its attention, and turning what it computed into traces."""
