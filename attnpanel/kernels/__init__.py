"""The attention computation itself: masks, the layer, exact tiles, memory and rounding.

torch and numpy only; nothing here knows xarray, a trace or a plot."""
