"""Command line of the agent.

python -m workers.agent --url URL --credential-file PATH [--state-dir DIR] [--slots N]
    [--executor process] [--once]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from workers.agent.agent import Agent, log
from workers.agent.executor import ProcessSpawner
from workers.agent.journal import Journal, StateDirError, default_state_dir
from workers.agent.protocol import STOP_GRACE_S
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
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="The agent's durable inbox: its journal of offers and processes (created 0700; "
        "one agent per directory; default: $XDG_STATE_HOME/qinglong-agent, else "
        "~/.local/state/qinglong-agent). Keep it across restarts: the restarted agent ends "
        "and reports what the previous one left running.",
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
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=STOP_GRACE_S,
        help=f"Seconds between SIGTERM and SIGKILL when a process group is stopped "
        f"(default {STOP_GRACE_S:g}).",
    )
    parser.add_argument(
        "--no-batch-acks",
        dest="batch_acks",
        action="store_false",
        help="Send every ACK in a request of its own (POST leases/{offer_id}/ack) instead of "
        "several per request (POST acks); the agent falls back to this by itself when the "
        "control plane has no POST acks.",
    )
    parser.add_argument("--once", action="store_true", help="One pull; run its offers; exit.")
    args = parser.parse_args(argv)
    if args.slots < 1:
        parser.error("--slots must be >= 1")
    if args.stop_grace < 0:
        parser.error("--stop-grace must be >= 0")
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
    state_dir = args.state_dir if args.state_dir is not None else default_state_dir()
    try:
        journal = Journal.open(state_dir)
    except (StateDirError, OSError) as err:
        log("state_dir_unusable", state_dir=str(state_dir), error=str(err))
        return 2
    agent = Agent(
        transport=transport,
        credential=credential,
        slots=args.slots,
        executor=args.executor,
        spawn=ProcessSpawner(args.workdir),
        journal=journal,
        poll_interval_s=args.poll_interval,
        long_poll_s=max(0, args.long_poll),
        stop_grace_s=args.stop_grace,
        batch_acks=args.batch_acks,
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        # First signal: stop pulling, drain (running Attempts finish and are
        # ACKed). Second: end every process now; the journal keeps the rest.
        if agent.stopping.is_set():
            agent.abort()
        else:
            agent.drain()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return agent.run(once=args.once)
    finally:
        journal.close()


if __name__ == "__main__":
    sys.exit(main())
