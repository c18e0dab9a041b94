"""The interactive explorer: its state, the live-update engine, the page's sections,
the explorer kinds and what a served explorer shares between sessions."""
