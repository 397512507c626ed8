"""Command line of the agent.

python -m workers.agent --url URL --credential-file PATH [--slots N] [--executor process] [--once]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from workers.agent.agent import Agent, log
from workers.agent.executor import ProcessSpawner
from workers.agent.transport import HttpTransport


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m workers.agent",
        description="The Qinglong reference Worker agent (runs offers as local processes).",
    )
    parser.add_argument("--url", required=True, help="Control plane base URL.")
    parser.add_argument(
        "--credential-file", required=True, type=Path, help="File holding the Worker credential."
    )
    parser.add_argument("--slots", type=int, default=1, help="Concurrent Attempts (default 1).")
    parser.add_argument("--executor", choices=("process",), default="process")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path.cwd(),
        help="Work directory (default: the current one): a spec's cwd is relative to it, "
        "and a cwd that resolves outside it is refused.",
    )
    parser.add_argument("--poll-interval", type=float, default=1.0, help="Seconds between pulls.")
    parser.add_argument(
        "--long-poll",
        type=int,
        default=0,
        help="Seconds a pull may wait for an offer (cluster with QL_PULL_WAIT_MAX_S; default 0).",
    )
    parser.add_argument("--once", action="store_true", help="One pull; run its offers; exit.")
    args = parser.parse_args(argv)
    if args.slots < 1:
        parser.error("--slots must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    credential = args.credential_file.read_text(encoding="utf-8").strip()
    if not credential:
        log("credential_missing")
        return 2
    try:
        transport = HttpTransport(args.url)
    except ValueError as err:
        # e.g. http:// to a non-loopback host: the credential would travel in clear.
        log("bad_url", error=str(err))
        return 2
    agent = Agent(
        transport=transport,
        credential=credential,
        slots=args.slots,
        executor=args.executor,
        spawn=ProcessSpawner(args.workdir),
        poll_interval_s=args.poll_interval,
        long_poll_s=max(0, args.long_poll),
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        # Stop pulling, drain: running Attempts finish and are ACKed.
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return agent.run(once=args.once)


if __name__ == "__main__":
    sys.exit(main())
