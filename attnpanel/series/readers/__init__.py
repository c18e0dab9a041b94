"""The recording formats, one module each; importing this package registers them all."""

from attnpanel.series.readers import frame, nilmtk, refit, ukdale  # noqa: F401
