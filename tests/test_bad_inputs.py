"""Every bad input a new user met (issue 11) gets a clear message naming the problem, or
works: empty inputs, one position, text timestamps, a batch out of range, 1000 heads, a port
out of range.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bokeh.document import Document

from attnpanel import MultiHeadSelfAttention
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.cli import main
from attnpanel.readouts.raster import raster_values
from attnpanel.render.export import export_html
from attnpanel.traces.build import trace
from attnpanel.traces.io import save
from attnpanel.traces.stages import recompute_weights


def small(mask: str = "none", d_model: int = 16, heads: int = 2):
    return MultiHeadSelfAttention(d_model, heads, mask=mask).eval()


@pytest.mark.parametrize("batch, length", [(1, 0), (0, 4)])
def test_empty_input_is_refused(batch, length):
    with pytest.raises(ValueError, match=rf"x is empty \(batch={batch}, length={length}\)"):
        trace(small(), torch.randn(batch, length, 16))


def test_empty_trace_is_refused_by_the_explorer():
    empty = trace(small(), torch.randn(1, 4, 16)).isel(query=slice(0, 0), key=slice(0, 0))
    with pytest.raises(ValueError, match="this trace is empty .*query=0, key=0"):
        AttentionExplorer(empty)


def test_one_position_is_explored_and_drawn():
    """L = 1: one query, one key, weight 1 (datashader alone cannot grid one cell)."""
    ds = trace(small(), torch.randn(1, 1, 16))
    explorer = AttentionExplorer(ds)
    explorer.__panel__().get_root(Document())
    drawn = explorer.drawn("matrix")
    assert drawn.size >= 1 and np.allclose(drawn, ds["weights"].values[0, 0, 0, 0])
    assert float(ds["weights"].values[0, 0, 0, 0]) == pytest.approx(1.0)


def test_raster_of_one_row_shows_each_cell_under_its_pixels():
    values = np.array([[0.25, 0.75]], dtype=np.float32)  # 1 query x 2 keys
    raster, window = raster_values(values, (-0.5, -0.5, 1.5, 0.5), 4, 2)
    assert window == (-0.5, -0.5, 1.5, 0.5)
    assert raster.shape == (1, 2) and raster.tolist() == [[0.25, 0.75]]
    zoomed, _ = raster_values(values, (-0.5, -0.5, 1.5, 0.5), 4, 2, x_range=(-1.5, 0.5))
    assert np.isnan(zoomed[0, 0]) and zoomed[0, 1] == 0.25  # left of the grid: nothing


def test_timestamps_written_as_text_are_read_as_dates():
    written = ["2024-05-01 08:00", "2024-05-01 08:01", "2024-05-01 08:02"]
    ds = trace(small(), torch.randn(1, 3, 16), time=written)
    assert ds["time"].dtype == np.dtype("datetime64[ns]")
    assert str(ds["time"].values[2]).startswith("2024-05-01T08:02")
    explorer = AttentionExplorer(ds)
    explorer.__panel__().get_root(Document())  # the time axis and its query marker draw


def test_text_that_is_no_date_is_refused_as_time():
    with pytest.raises(ValueError, match="time holds text that is not a date.*tokens="):
        trace(small(), torch.randn(1, 3, 16), time=["a", "b", "c"])


def test_a_batch_out_of_range_is_named():
    ds = trace(small(), torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="batch 99 is out of range: this trace has 2"):
        recompute_weights(ds, None, batch=99)


def test_export_of_a_thousand_heads_says_what_does_not_fit(tmp_path):
    ds = trace(small(d_model=1000, heads=1000), torch.randn(1, 4, 1000))
    with pytest.raises(ValueError, match="1000 heads are more than the 256 it lays out"):
        export_html(ds, tmp_path / "many.html")
    assert not (tmp_path / "many.html").exists()


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_serve_refuses_a_port_out_of_range(port, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--port", port])
    assert stop.value.code == 2
    assert "argument --port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("procs", "says"),
    [("-1", "give 0 (one per core) or more"), ("many", "is not a number of processes")],
)
def test_serve_refuses_a_bad_number_of_processes(procs, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--num-procs", procs])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --num-procs" in err and says in err


def test_export_refuses_a_query_out_of_range(tmp_path, capsys):
    path = tmp_path / "t.nc"
    save(trace(small(), torch.randn(1, 16, 16)), path)
    assert main(["export", str(path), "-o", str(tmp_path / "x.html"), "--query", "500"]) != 0
    err = capsys.readouterr().err
    assert "query 500 is out of range: the trace has 16 query positions" in err
    assert "Traceback" not in err and not (tmp_path / "x.html").exists()
