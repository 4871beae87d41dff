"""`huorn crds`: write the CustomResourceDefinitions generated from the models.

The files are committed, so `kubectl apply -f crds/` works from a checkout without Python;
`--check` lets CI (and the test suite) prove they still match the models.
"""

from __future__ import annotations

from pathlib import Path

import typer

from huorn.api import crdgen
from huorn.cli.output import check_writable, print_error

EXIT_STALE = 1
EXIT_INVALID = 2


def crds_command(
    output_dir: Path = typer.Option(Path("crds"), "--output-dir", "-d", help="Where to write the CRD files."),
    check: bool = typer.Option(
        False, "--check",
        help="Write nothing; exit 1 if the files there are missing or differ from the models, 2 if "
             "the directory is not there."
    ),
) -> None:
    """Generate crds/<plural>.huorn.io.yaml from the API models (install with kubectl apply -f crds/)."""
    if check:
        fix = f"run `huorn crds --output-dir {output_dir}`"
        if not output_dir.is_dir():
            # NB: a mistyped -d is not four stale CRDs: name the directory, exit 2 (bad input)
            what = "is a file, not a directory" if output_dir.exists() else "no such directory"
            print_error(f"--output-dir {output_dir}: {what}; give the directory that holds the CRDs, or "
                        f"{fix} to write them")
            raise typer.Exit(EXIT_INVALID)
        stale = crdgen.describe_stale_crds(output_dir)
        for name, how in stale.items():
            typer.echo(f"{output_dir / name}: {how}", err=True)
        if stale:
            missing = sum(how == "missing" for how in stale.values())
            summary = f"{missing} missing, {len(stale) - missing} out of date"
            typer.echo(f"{output_dir}: {summary}; {fix}", err=True)
            raise typer.Exit(EXIT_STALE)
        typer.echo(f"{output_dir}: up to date")
        return
    check_writable(output_dir, "--output-dir", directory=True)
    for path in crdgen.write_crds(output_dir):
        typer.echo(f"wrote {path}")
