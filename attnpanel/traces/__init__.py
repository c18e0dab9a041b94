"""The trace, attnpanel's data model: its schema, how it is built, recomputed, validated,
stored and read, and its virtual (row statistics) form with overview levels."""
