"""Daemon subcommands: ``serve`` and ``health``."""

from __future__ import annotations

import argparse
import sys
import time

from evald.cli import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, Runner, add_client_options, command

__all__: list[str] = []


@command("serve", "Run the daemon (until SIGTERM/SIGINT, then drain in-flight calls).", order=10)
def _serve(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "--listen",
        metavar="ADDR",
        help="unix:PATH or HOST:PORT (default: config's [server].listen, else $EVALD_TARGET, "
        "else unix:$XDG_RUNTIME_DIR/evald.sock, else unix:/tmp/evald-$UID.sock)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config (default: $EVALD_CONFIG, else the packaged default_config.toml)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="registered modules and caches (default: config's, else $XDG_STATE_HOME/evald, "
        "else ~/.local/state/evald)",
    )
    parser.add_argument(
        "--cpus",
        metavar="LIST",
        help='run on these CPUs only, a Linux cpu-list such as "1" or "2-3,6" (default: '
        "config's [server].cpus, else every CPU the daemon is given); bind the engine to the "
        "others",
    )
    parser.add_argument(
        "--parent-fd",
        type=int,
        metavar="FD",
        help="stop (as on SIGTERM) when this inherited pipe reaches end-of-file: the program "
        "that started the daemon holds the write end, so the daemon dies with it however it dies",
    )

    def run(args: argparse.Namespace) -> int:
        from evald.contract import EvaldError
        from evald.daemon import ConfigError, load_config, parse_cpu_list

        try:
            cpus = parse_cpu_list(args.cpus) if args.cpus is not None else None
        except ValueError as exc:
            print(f"error: invalid_argument: --cpus: {exc}", file=sys.stderr)
            return EXIT_ERROR
        try:
            config = load_config(args.config).with_overrides(
                listen=args.listen, state_dir=args.state_dir, cpus=cpus
            )
        except ConfigError as exc:
            print(f"error: invalid_argument: {exc}", file=sys.stderr)
            return EXIT_ERROR
        from evald.daemon import serve

        if args.parent_fd is not None:
            from evald.daemon import watch_parent

            try:
                watch_parent(args.parent_fd, grace_s=config.server.shutdown_grace_s)
            except OSError as exc:
                message = f"--parent-fd {args.parent_fd}: {exc}"
                print(f"error: invalid_argument: {message}", file=sys.stderr)
                return EXIT_ERROR
        try:
            serve(config)
        except ConfigError as exc:  # a setting the machine cannot honour ([server] cpus)
            print(f"error: invalid_argument: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except EvaldError as exc:
            print(f"error: {exc.code.value}: {exc.message}", file=sys.stderr)
            return EXIT_UNREACHABLE
        return EXIT_OK

    return run


@command("health", "Ask a daemon whether it is serving (exit 0 if so).", order=15)
def _health(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "--wait", type=float, default=0.0, metavar="S", help="retry for up to S seconds"
    )
    parser.add_argument("--service", default="", help="service name (default: the whole server)")
    add_client_options(parser)

    def run(args: argparse.Namespace) -> int:
        from evald.client import CallError, Client

        give_up = time.monotonic() + args.wait
        with Client(
            args.target,
            args.token,
            timeout_s=args.timeout,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        ) as client:
            while True:
                try:
                    status = client.health(args.service)
                except CallError as error:
                    if time.monotonic() < give_up:
                        time.sleep(0.05)
                        continue
                    kind = "unreachable" if error.unreachable else error.code
                    print(f"error: {kind}: {error.message}", file=sys.stderr)
                    return EXIT_UNREACHABLE if error.unreachable else EXIT_ERROR
                if status == "SERVING" or time.monotonic() >= give_up:
                    break
                time.sleep(0.05)
            degraded = ""
            if status == "SERVING" and not args.service:
                degraded = _store_problem(client)
        print(status + degraded)
        return EXIT_OK if status == "SERVING" else EXIT_ERROR

    return run


def _store_problem(client: object) -> str:
    """`` (degraded: …)`` when the daemon cannot reach its store (health service
    ``evald.v1.Store`` NOT_SERVING): it serves what it has; else empty."""
    from evald.client import CallError, Client
    from evald.daemon import STORE_HEALTH_SERVICE

    assert isinstance(client, Client)
    try:
        store = client.health(STORE_HEALTH_SERVICE)
    except CallError:  # a daemon without the service: nothing to say
        return ""
    if store == "SERVING":
        return ""
    return " (degraded: the fleet store is unreachable; serving what the daemon has)"
