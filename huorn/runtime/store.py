"""A stand-alone c10d TCPStore that serves the rendezvous of one elastic gang.

It lives in its own process (a vertex of the execution graph in Kubernetes) so that losing any
worker replica never takes the rendezvous with it. It holds only small keys, so it is cheap to
keep alive for the whole job.

    python -m huorn.runtime.store --host 127.0.0.1 --port 0 --port-file run/store.port
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore


def serve_store(host: str, port: int, port_file: Path | None = None) -> None:
    """Host the store until SIGTERM/SIGINT; the chosen port is written atomically to port_file."""
    store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    if port_file is not None:
        port_file.parent.mkdir(parents=True, exist_ok=True)
        scratch = port_file.with_name(port_file.name + ".tmp")
        scratch.write_text(f"{store.port}\n")
        os.replace(scratch, port_file)
    print(f"huorn store serving on {host}:{store.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.store", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", type=Path, default=None, help="where to write the chosen port")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    serve_store(args.host, args.port, args.port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
