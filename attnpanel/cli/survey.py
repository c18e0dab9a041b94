"""``attnpanel survey``: how every head behaves over a dataset, kept in a zarr store."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnpanel.cli.common import CommandError, first_line, say
from attnpanel.cli.models import checkpoint_run, hugging_face_model, model_inputs
from attnpanel.cli.recording import (
    add_recording_options,
    recording_model,
    wants_recording,
)

EXTREMES = 5  # heads listed per statistic


def survey_lines(found) -> list[str]:
    """A survey's summary: its size, and per statistic the heads at its extremes (the mean
    over samples of each head)."""
    samples, layers, heads = (found.sizes[d] for d in ("sample", "layer", "head"))
    lines = [
        f"survey of {found.attrs.get('model', '?')}: {samples} samples, {layers} layers x "
        f"{heads} heads"
    ]
    means = found.mean("sample")
    for stat, order, what in (
        ("sink", "most", "weight on the first key"),
        ("entropy", "least", "entropy (nats), the most focused"),
        ("distance", "most", "distance (steps), the farthest looking"),
        ("previous_share", "most", "weight on the previous position"),
    ):
        if stat not in means:
            continue
        series = means[stat].to_series().dropna()
        series = series.nsmallest(EXTREMES) if order == "least" else series.nlargest(EXTREMES)
        picks = ", ".join(
            f"{layer} head {head}: {value:.3g}" for (layer, head), value in series.items()
        )
        lines.append(f"  {what}: {picks}")
    if "offset" in found:
        from attnpanel.surveys.roles import head_roles

        roles = head_roles(found, step=found.attrs.get("step"))
        lines.append("  roles (attnpanel.head_roles; thresholds in docs/survey.md):")
        for layer in roles["layer"].values:
            named = [
                f"{head}: {roles['role'].sel(layer=layer, head=head).item()}"
                for head in roles["head"].values
            ]
            lines.append(f"    {layer}  " + ", ".join(named))
        if "token_roles" in roles.attrs:
            lines.append(f"  ({roles.attrs['token_roles']})")
    return lines


def _batches(args) -> tuple:
    """The model, its inputs cut into batches of ``--batch``, and the survey's options for
    them: the step in seconds, and for a recording's model the positions' layout (its named
    tokens) and its batches' reading (each is already the model's ``(args, kwargs)``)."""
    if wants_recording(args):
        run_model = recording_model(args)  # every window of the recording
        windows = run_model.windows
        batches = []
        for start in range(0, windows.sizes["window"], args.batch):
            part = run_model.subset(slice(start, start + args.batch))
            batches.append(part.inputs())
        from attnpanel.series.windows import step_seconds

        layout = run_model.recipe.position_layout()
        options = dict(step=step_seconds(windows), layout=layout, prepare=_as_kept)
        return run_model.model, batches, options
    if (args.model is None) == (args.checkpoint is None):
        raise CommandError("give either --checkpoint or --model with --text-file")
    if args.model is not None:
        if not args.text_file:
            raise CommandError("--model needs --text-file (one text per line)")
        path = Path(args.text_file)
        if not path.is_file():
            raise CommandError(f"no text file at {path}")
        texts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise CommandError(f"{path} holds no text")
        model, tokenizer = hugging_face_model(Path(args.model))
        batches = [
            model_inputs(model, tokenizer, texts[i : i + args.batch])
            for i in range(0, len(texts), args.batch)
        ]
        return model, batches, {}
    model, (aggregate, features), _ = checkpoint_run(Path(args.checkpoint), args.windows)
    batches = [
        (aggregate[i : i + args.batch], features[i : i + args.batch])
        for i in range(0, len(aggregate), args.batch)
    ]
    return model, batches, dict(step=60.0 * float(args.step_minutes))


def _as_kept(batch) -> tuple[tuple, dict]:
    """A recording's batch as it is kept: the recipe's ``(args, kwargs)``."""
    return batch


def run(args: argparse.Namespace) -> None:
    """Survey a model over its inputs into a zarr store, resuming a store it began."""
    from attnpanel.capturing.recorder import CaptureError
    from attnpanel.surveys.store import SurveyStore, SurveyStoreError
    from attnpanel.surveys.survey import survey

    if not args.output.lower().rstrip("/").endswith(".zarr"):
        raise CommandError(f"a survey is kept in a zarr store: {args.output} does not end in .zarr")
    store = SurveyStore(Path(args.output))
    model, batches, options = _batches(args)
    try:
        held = store.attrs()
    except SurveyStoreError as error:
        raise CommandError(str(error)) from error
    if held is not None:
        say(f"resuming {args.output}: {held.get('samples_done', 0)} samples done")
    try:
        found = survey(model, batches, scheduler=args.scheduler, store=args.output, **options)
    except KeyboardInterrupt:
        done = (store.attrs() or {}).get("samples_done", 0)
        say(
            f"interrupted: {args.output} holds {done} whole samples; run the same command "
            "again to resume"
        )
        raise  # the command line's exit status 130
    except (SurveyStoreError, CaptureError, ValueError, TypeError, RuntimeError) as error:
        raise CommandError(f"{type(model).__name__}: {first_line(error)}") from error
    say(f"wrote {args.output}")
    for line in survey_lines(found):
        say(line)


def add_parser(sub) -> None:
    """Add the command and its options to the ``attnpanel`` parser's subcommands."""
    survey = sub.add_parser(
        "survey",
        help="statistics of every head over a dataset, in a zarr store that resumes",
        description="Run a model over many inputs and keep, per sample, layer and head, its "
        "attention statistics (entropy, distance, sink, diagonal and previous share, max "
        "weight, and their value-weighted forms) in a zarr store, batch by batch; the same "
        "command resumes an interrupted survey.",
    )
    survey.add_argument(
        "--checkpoint",
        help="a NILMFormer model file (as `attnpanel train` writes), run on the demo's "
        "held-out windows; with --model SPEC, that model's weights (on every window of "
        "--recording)",
    )
    survey.add_argument("--windows", type=int, default=1024, help="held-out windows (1024)")
    survey.add_argument("--step-minutes", type=float, default=1.0, help="minutes per step (1)")
    survey.add_argument(
        "--model",
        help="a local Hugging Face model directory with its tokenizer (offline), or "
        "FILE.py:FUNCTION / package.module:FUNCTION returning your model (with --recording)",
    )
    survey.add_argument("--text-file", help="texts for --model, one per line")
    survey.add_argument("--batch", type=int, default=32, help="inputs per batch (32)")
    survey.add_argument(
        "--scheduler",
        help="run on dask.distributed: a scheduler's address (tcp://host:8786), or 'local' "
        "for a LocalCluster of this machine; in process by default",
    )
    survey.add_argument("-o", "--output", required=True, help="the survey store (.zarr)")
    add_recording_options(survey, shared=True)
    survey.set_defaults(func=run)
