"""Everything that draws: Bokeh figures, HoloViews elements, colours, the offline HTML export."""
