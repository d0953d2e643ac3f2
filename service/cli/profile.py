"""``pipeplan profile``: a model (a zoo name, a factory, ``hf:``; or a PipeDream import)
into profile.json; ``gen:NAME`` writes a large model's analytic profile from its shape
(:mod:`models.shapes`: no torch model is built)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeplan.core.profile import ModelProfile
from pipeplan.models import shapes, zoo
from pipeplan.service.cli.console import CliError, ConsoleReporter, clean_errors, cluster_ref, say
from pipeplan.service.cli.options import (
    MODEL_FORMS,
    NO_MODEL_FLAGS,
    EmulatedClusterOpt,
    MeasureOpt,
    ModelFlags,
    model_flag_options,
)
from pipeplan.service.tasks.profile import (
    PipedreamRequest,
    ProfileRequest,
    import_pipedream,
    profile,
)

AddressOpt = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="with --measure: a running Ray cluster (HOST:PORT, or 'auto' for `pipeplan "
        "cluster up`'s) instead of starting one",
    ),
]


def _pipedream(
    path: Path, batch_size: int | None, device_type: str | None, name: str | None
) -> ModelProfile:
    if batch_size is None:
        raise CliError("--batch-size: required with --pipedream (the minibatch it was taken at)")
    if not device_type:
        raise CliError("--device-type: required with --pipedream (the GPU it was taken on)")
    return import_pipedream(
        PipedreamRequest(path=path, batch_size=batch_size, device_type=device_type, name=name)
    )


def _generated(
    model: str, input_size: int | None, model_flags: ModelFlags, unused: dict[str, bool]
) -> ModelProfile:
    """A ``gen:`` model's profile from its shape; a flag that measures or builds a model is
    refused, naming it."""
    for flag, given in unused.items():
        if given:
            raise CliError(
                f"{flag}: not with a generated model ({model}): its profile is analytic, "
                "sizes from formulas, no model to build or time"
            )
    options = model_flags.source_kwargs()["options"]
    return shapes.generate(model, input_size, options)


def _write(prof: ModelProfile, output: Path) -> None:
    prof.save(output)
    types = ", ".join(prof.device_types) or "no device type (analytic)"
    say(
        f"wrote {output}: {len(prof)} layers, {prof.params_bytes / 1e6:.2f} MB params, "
        f"{prof.flops / 1e9:.3f} GFLOPs/sample, timings for {types}"
    )


@clean_errors
@model_flag_options()
def profile_command(
    model: Annotated[str | None, typer.Argument(help=f"the model: {MODEL_FORMS}")] = None,
    input_size: Annotated[int | None, typer.Option(help="input height/width (or tokens)")] = None,
    model_flags: ModelFlags = NO_MODEL_FLAGS,
    device_type: Annotated[
        str | None,
        typer.Option(help="measure layer times on this machine under this device-type name"),
    ] = None,
    cluster: EmulatedClusterOpt = None,
    pipedream: Annotated[Path | None, typer.Option(help="import a PipeDream graph.txt")] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="minibatch the PipeDream profile was taken at")
    ] = None,
    measure: MeasureOpt = False,
    address: AddressOpt = None,
    output: Annotated[Path | None, typer.Option("-o", "--output")] = None,
    text: Annotated[bool, typer.Option("--text", help="print TAPP's text library")] = False,
    list_models: Annotated[
        bool, typer.Option("--list", help="list zoo and generated models")
    ] = False,
) -> None:
    """Profile a zoo model (or import a PipeDream profile) into profile.json.

    MODEL may also be a factory (package.module:factory), a transformers class
    (hf:ClassName), or a generated model (gen:gpt-13b, gen:gpt-30b, gen:gpt-70b, gen:vit-h14,
    gen:resnet152): an analytic profile from its shape, options by -M (e.g. -M n_layer=48,
    -M precision=fp32).
    """
    if list_models:
        typer.echo("\n".join([*zoo.MODELS, *shapes.names()]))
        return
    if model is not None and shapes.is_generated(model):
        flags = model_flags
        unused = {
            "--device-type": device_type is not None, "--cluster": cluster is not None,
            "--pipedream": pipedream is not None, "--measure": measure,
            "--address": address is not None, "--input-shape": flags.input_shape is not None,
            "--input-dtype": flags.input_dtype is not None, "--example": flags.example is not None,
        }  # fmt: skip
        prof = _generated(model, input_size, model_flags, unused)
    elif pipedream is not None and not (measure or address):
        prof = _pipedream(pipedream, batch_size, device_type, model)
    elif model is None or pipedream is not None:
        raise CliError(
            f"profile: give a MODEL name (one of {', '.join(zoo.MODELS)}) or --pipedream FILE"
        )
    else:
        request = ProfileRequest(
            model=model,
            input_size=input_size,
            **model_flags.fields(),
            device_type=device_type,
            cluster=cluster_ref(cluster) if cluster is not None else None,
            measure=measure,
            address=address,
        )
        prof = profile(request, ConsoleReporter())
    if output is not None:
        _write(prof, output)
    if text or output is None:
        typer.echo(prof.text_library())


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)
