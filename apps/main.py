"""attnpanel served app (placeholder until the explorer lands)."""

import panel as pn

pn.extension(inline=True)
pn.pane.Markdown("# attnpanel\nThe explorer is being built.").servable()
