"""`huorn crds`: write the CustomResourceDefinitions generated from the models.

The files are committed, so `kubectl apply -f crds/` works from a checkout without Python;
`--check` lets CI (and the test suite) prove they still match the models.
"""

from __future__ import annotations

from pathlib import Path

import typer

from huorn.api import crdgen
from huorn.cli.output import check_writable

EXIT_STALE = 1


def crds_command(
    output_dir: Path = typer.Option(Path("crds"), "--output-dir", "-d", help="Where to write the CRD files."),
    check: bool = typer.Option(
        False, "--check", help="Write nothing; exit 1 if the files there differ from the models."
    ),
) -> None:
    """Generate crds/<plural>.huorn.io.yaml from the API models (install with kubectl apply -f crds/)."""
    if check:
        stale = crdgen.list_stale_crds(output_dir)
        for name in stale:
            fix = f"run `huorn crds --output-dir {output_dir}`"
            typer.echo(f"{output_dir / name}: out of date; {fix}", err=True)
        if stale:
            raise typer.Exit(EXIT_STALE)
        typer.echo(f"{output_dir}: up to date")
        return
    check_writable(output_dir, "--output-dir", directory=True)
    for path in crdgen.write_crds(output_dir):
        typer.echo(f"wrote {path}")
