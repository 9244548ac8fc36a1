"""One fuzz run, start to end: the daemon, the set-up, the classes, the checks, the report.

Order: start the daemon (or reach ``--target``); list the evaluators; the victim registers its
canary modules and the attacker its malicious ones (refused ones must be refused); measure the
noisy neighbour; run the main loop until the budget is spent; kill -9 the daemon under load and
restart it; run the full-disk scenario on a second daemon; stop the daemon (it must exit 0) and
write the report. A monitor thread samples the daemon's RSS and health all along.

The main loop keeps ``lanes`` steps in flight. Each step belongs to one class (generated, corpus,
modules, protocol) and draws its inputs from ``random.Random(f"{seed}:{class}:{n}")``, so what a
step sends depends only on the seed and its number, not on thread timing. The class of the next
step is the one furthest behind its share of the budget.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any

from evald.client import CallError, Client
from evald.daemon import Config, load_config, parse_config
from evald_lab.fuzz import faults, noisy, protocol
from evald_lab.fuzz.checks import (
    LIMIT_ESCAPES,
    Canaries,
    Checker,
    Recorder,
    TenantBounds,
    Violation,
    outcome_label,
)
from evald_lab.fuzz.context import FuzzContext, Item
from evald_lab.fuzz.corpus import attacks_for
from evald_lab.fuzz.generate import GrammarError, GrammarGenerator, mutate
from evald_lab.fuzz.modules import (
    MaliciousModule,
    accepted_modules,
    mutated_module,
    refused_modules,
)
from evald_lab.fuzz.settings import FuzzSettings, fuzz_config
from evald_lab.harness import DaemonProcess, free_port, process_rss_bytes, start_daemon
from evaluators_wasm import STANDARD_EVALUATORS

__all__ = ["HARDENING", "run_fuzz"]

CLASSES = ("generated", "corpus", "modules", "protocol")

#: What fuzzing and reviews found and the daemon now does (each has a regression test under
#: tests/evald/: daemon/test_hardening.py, daemon/test_server_memory.py,
#: daemon/test_data_path_memory.py, contract/test_alphabet.py, host/test_epoch_ticker.py).
HARDENING = (
    "A corrupt protobuf request got gRPC's untyped UNKNOWN (unary) or `internal` (stream); "
    "now `invalid_argument` with a message (lenient deserializers in the service).",
    "Tables were uncapped: one `table.fill`/`table.grow` (a single instruction, so neither fuel "
    "nor the epoch stops it) committed ~400 MB and ran 1 s past a 20 ms deadline; stores now "
    "hold at most 4 tables of 65,536 elements.",
    "A compile bomb (a 1.2 MB module of 60,000 tiny functions) took about a minute of CPU at "
    "registration, which cannot be interrupted; the validator caps modules at 10,000 functions "
    "and 1 MiB of code before compiling.",
    "Large messages without a token were read and parsed before authentication (4 clients took "
    "the daemon from 82 MiB to 3.3 GiB); calls are now refused from their metadata, unread.",
    "Streams were bounded in unread results, not bytes (541 MiB held by three non-reading "
    "streams); now in bytes per stream and per tenant, and a stalled stream is cut off.",
    "A batch whose values exceeded the send limit failed whole with a bare RESOURCE_EXHAUSTED; "
    "now every item gets its value or its own output_too_large.",
    "The daemon accepted result regexes that can produce '<' (a role injection through forced "
    "special tokens); the ABI's rule is now enforced at every load.",
    "The epoch ticker waited for the GIL (deadlines overran by up to 1.44 s); it is now a "
    "native thread.",
    "The data path bounded unread output in results (max_batch_items per connection: three "
    "non-reading connections took the daemon from 81 to 192 MiB within a second and growing), "
    "sent a burst as one frame of any size and did not count connections in max_calls; it now "
    "shares the streams' byte budgets and stall cut-off, splits frames, and counts them.",
)


def _bounds(config: Config) -> dict[str, TenantBounds]:
    return {
        tenant.name: TenantBounds(
            name=tenant.name,
            fuel=tenant.limits.fuel,
            deadline_ms=tenant.limits.deadline_ms,
            memory_bytes=tenant.limits.memory_bytes,
            input_bytes=tenant.limits.input_bytes,
            output_bytes=tenant.limits.output_bytes,
        )
        for tenant in config.tenants
    }


class _Monitor(threading.Thread):
    """Samples the daemon's RSS and asks its health service, every ``period_s``."""

    def __init__(self, run: FuzzRun, period_s: float = 0.5) -> None:
        super().__init__(name="fuzz-monitor", daemon=True)
        self.run_ = run
        self.period_s = period_s
        self.paused = threading.Event()
        self.done = threading.Event()
        self.peak_rss = 0
        self.samples = 0
        self.health_checks = 0
        self.crashed = False

    def run(self) -> None:
        client: Client | None = None
        try:
            while not self.done.wait(self.period_s):
                if self.paused.is_set():
                    if client is not None:
                        client.close()
                        client = None
                    continue
                self.sample()
                if client is None:
                    client = Client(self.run_.ctx.target, timeout_s=5.0)
                self.check_health(client)
        finally:
            if client is not None:
                client.close()

    def sample(self) -> None:
        pid = self.run_.daemon_pid()
        if pid is None:
            return
        rss = process_rss_bytes(pid)
        if rss is None:
            if not self.paused.is_set() and not self.crashed:
                self.crashed = True
                self.run_.recorder.add([Violation("crash", "daemon", "the daemon process is gone")])
                self.run_.ctx.stop.set()
            return
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.run_.recorder.add(Checker.rss(rss, self.run_.settings.rss_bound_bytes))

    def check_health(self, client: Client) -> None:
        try:
            status = client.health()
        except CallError as error:
            if self.paused.is_set():
                return
            alive = self.run_.daemon_alive()
            kind = "hang" if alive else "crash"
            self.run_.recorder.add([Violation(kind, "daemon", f"health check failed: {error}")])
            if not alive:
                self.crashed = True
                self.run_.ctx.stop.set()
            return
        self.health_checks += 1
        if status != "SERVING" and not self.paused.is_set():
            self.run_.recorder.add([Violation("hang", "daemon", f"health says {status}")])


class FuzzRun:
    """A run; :meth:`execute` does everything and returns the report."""

    def __init__(self, settings: FuzzSettings, *, console: Any = None) -> None:
        self.settings = settings
        self.console = console
        self.profile = settings.profile
        self.recorder = Recorder((*CLASSES, "noisy_neighbour", "fault_kill9", "fault_disk_full"))
        self.daemon: DaemonProcess | None = None
        self.root: Path | None = None
        self.config_text = ""
        self._planned_down = threading.Event()
        self.generators: dict[str, GrammarGenerator] = {}
        self.accepted: list[MaliciousModule] = []
        self.refused: list[MaliciousModule] = []
        self.step_numbers = dict.fromkeys(CLASSES, 0)
        self.ctx: FuzzContext

    # Daemon -----------------------------------------------------------------------------------

    def daemon_pid(self) -> int | None:
        if self.daemon is not None:
            return self.daemon.pid
        return self.settings.target_pid

    def daemon_alive(self) -> bool:
        if self.daemon is not None:
            return self.daemon.alive()
        pid = self.settings.target_pid
        return pid is None or process_rss_bytes(pid) is not None

    def _start_own_daemon(self) -> tuple[Config, str, dict[str, str], int]:
        root = Path(tempfile.mkdtemp(prefix="evald-fuzz-", dir=self.settings.work_dir))
        self.root = root
        tokens = {"victim": secrets.token_urlsafe(24), "attacker": secrets.token_urlsafe(24)}
        metrics_port = free_port()
        self.config_text = fuzz_config(
            victim_token=tokens["victim"],
            attacker_token=tokens["attacker"],
            threads=self.settings.threads,
            metrics_port=metrics_port,
            data_listen=f"unix:{root / 'data.sock'}",
        )
        config = parse_config(self.config_text, "<fuzz config>")
        self.daemon = start_daemon(root, self.config_text, socket_path=root / "d.sock")
        return config, self.daemon.target, tokens, metrics_port

    def _restart(self) -> None:
        assert self.daemon is not None and self.root is not None
        self.daemon = start_daemon(
            self.root,
            self.config_text,
            socket_path=self.daemon.socket_path,
            state_dir=self.daemon.state_dir,
        )

    def _kill(self) -> None:
        assert self.daemon is not None
        self.daemon.kill()

    # Set-up -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        settings = self.settings
        if settings.target is None:
            config, target, tokens, metrics_port = self._start_own_daemon()
            victim, attacker = "victim", "attacker"
            metrics: int | None = metrics_port
        else:
            if settings.target_config is None:
                raise ValueError("--target needs --target-config (the daemon's config file)")
            config = load_config(settings.target_config)
            target = settings.target
            victim, attacker = settings.victim, settings.attacker
            tokens = {victim: settings.victim_token, attacker: settings.attacker_token}
            metrics = None
        bounds = _bounds(config)
        for name in (victim, attacker):
            if name not in bounds:
                raise ValueError(f"the daemon's config has no tenant {name!r}")
        canaries = Canaries()
        rng = random.Random(f"{settings.seed}:setup")
        tag = f"{rng.getrandbits(40):010x}"
        victim_canary = f"CANARY-V-{secrets.token_hex(12)}"
        attacker_canary = f"CANARY-A-{secrets.token_hex(12)}"
        canaries.add(victim, tokens[victim], victim_canary, f"v_secret_{tag}")
        canaries.add(attacker, tokens[attacker], attacker_canary)
        self.ctx = FuzzContext(
            target=target,
            tokens=tokens,
            victim=victim,
            attacker=attacker,
            bounds=bounds,
            checker=Checker(bounds, canaries, margin_ms=settings.margin_ms),
            recorder=self.recorder,
            canaries=canaries,
            threads=config.server.resolved_threads
            if settings.target is None
            else max(1, settings.threads),
            max_batch_items=config.server.max_batch_items,
            max_message_bytes=config.server.max_message_bytes,
            margin_ms=settings.margin_ms,
            metrics_port=metrics,
            data_target=config.server.data_listen or None,
        )
        ctx = self.ctx
        ctx.secrets.victim_echo = f"v_echo_{tag}"
        ctx.secrets.victim_secret = f"v_secret_{tag}"
        ctx.secrets.victim_canary = victim_canary
        ctx.secrets.attacker_canary = attacker_canary

        for info in ctx.client(attacker).list_evaluators():
            if info.owner != "standard":
                continue
            ctx.evaluators[info.name] = info
            ctx.checker.set_result_regex(info.name, info.result_regex)
            try:
                self.generators[info.name] = GrammarGenerator(info.input_grammar)
            except GrammarError as error:
                ctx.recorder.add(
                    [
                        Violation(
                            "unexpected", "generated", f"{info.name}: unreadable grammar: {error}"
                        )
                    ]
                )
        # The victim's canary modules (registered before everything else, so they persist).
        from evald_lab.wat_corpus import guest, manifest_bytes

        victim_client = ctx.client(victim)
        for name in (ctx.secrets.victim_echo, ctx.secrets.victim_secret):
            wasm = guest(
                "echo", manifest=manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
            )
            victim_client.register(wasm, replace=True)
        # The attacker's malicious modules.
        prefix = f"m{tag[:4]}_"
        attacker_bounds = bounds[attacker]
        self.refused = refused_modules(
            prefix, memory_bytes=attacker_bounds.memory_bytes, module_bytes=config.host.module_bytes
        )
        self.accepted = []
        attacker_client = ctx.client(attacker)
        for module in accepted_modules(
            prefix, output_bytes=attacker_bounds.output_bytes, shadow_name=ctx.secrets.victim_echo
        ):
            try:
                attacker_client.register(module.wasm, replace=True)
            except CallError as error:
                ctx.recorder.outcome(
                    "modules",
                    f"call:{error.code.value if error.code else 'unreachable'}",
                    family=f"register:{module.family}",
                )
                ctx.recorder.add(
                    [
                        Violation(
                            "unexpected",
                            "modules",
                            f"{module.family} was refused: {error.message[:160]}",
                        )
                    ]
                )
                continue
            ctx.recorder.outcome("modules", "registered", family=f"register:{module.family}")
            self.accepted.append(module)
            if module.family == "infinite_loop_in_eval":
                ctx.secrets.attacker_loop = module.name
        for module in self.refused:
            self._register_refused(module, random.Random(f"{settings.seed}:refused:{module.name}"))

    def _register_refused(self, module: MaliciousModule, rng: random.Random) -> None:
        ctx = self.ctx
        try:
            ctx.client(ctx.attacker).register(module.wasm, replace=rng.random() < 0.5)
        except CallError as error:
            code = error.code.value if error.code is not None else None
            ctx.recorder.outcome(
                "modules", f"call:{code or 'unreachable'}", family=f"register:{module.family}"
            )
            ctx.recorder.add(
                ctx.checker.call_error("modules", code, error.message, expected=module.refusal)
            )
            ctx.recorder.add(ctx.checker.text("modules", ctx.attacker, error.message))
            return
        ctx.recorder.outcome("modules", "registered", family=f"register:{module.family}")
        ctx.recorder.add(
            [
                Violation(
                    "unexpected", "modules", f"{module.family}: a malicious module was registered"
                )
            ]
        )
        with contextlib.suppress(CallError):
            ctx.client(ctx.attacker).delete(module.name)

    # Steps ------------------------------------------------------------------------------------

    def _generated(self, rng: random.Random) -> None:
        """Grammar-generated inputs, a quarter fresh and the rest mutations of those (generation
        costs about a millisecond an input in Python, a mutation tens of microseconds)."""
        ctx = self.ctx
        tenant = ctx.victim if rng.random() < 0.5 else ctx.attacker
        names = sorted(self.generators)
        size = self.profile.generated_batch
        pool: list[tuple[str, bytes]] = []
        for _ in range(max(8, size // 4)):
            name = rng.choice(names)
            pool.append(
                (name, self.generators[name].generate(rng).encode("utf-8", "surrogatepass"))
            )
        items: list[Item] = []
        for index in range(size):
            if tenant == ctx.victim and rng.random() < 0.03:
                canary = f"{ctx.secrets.victim_canary}-{rng.getrandbits(32):08x}"
                choice = rng.randrange(3)
                if choice == 0:
                    items.append(
                        Item(ctx.secrets.victim_echo, canary.encode(), "victim_canary_echo")
                    )
                else:
                    op = ("upper", "reverse")[choice - 1]
                    items.append(Item("strop", f'{op}("{canary}")'.encode(), "victim_canary_strop"))
                continue
            if index < len(pool):
                name, data = pool[index]
                items.append(Item(name, data, f"{name}:valid"))
                continue
            name, data = rng.choice(pool)
            data = mutate(data, rng, other=rng.choice(pool)[1])
            items.append(Item(name, data, f"{name}:mutated"))
        results = ctx.send(
            "generated", tenant, items, via="stream" if rng.random() < 0.5 else "batch"
        )
        for request, response in results:
            if response is None or not request.evaluator.startswith("v_echo_"):
                continue
            if (
                response.WhichOneof("outcome") != "value"
                or response.value.encode() != request.input
            ):
                ctx.recorder.add(
                    [
                        Violation(
                            "tenant_leak",
                            "generated",
                            "the victim's echo module did not return its own input",
                        )
                    ]
                )

    def _corpus(self, rng: random.Random) -> None:
        ctx = self.ctx
        evaluator = rng.choice(sorted(self.generators) or list(STANDARD_EVALUATORS))
        attacks = attacks_for(evaluator)
        light = [a for a in attacks if not a.heavy]
        heavy = [a for a in attacks if a.heavy]
        picks = [rng.choice(light) for _ in range(self.profile.corpus_light)]
        picks += [rng.choice(heavy) for _ in range(self.profile.corpus_heavy)]
        items = [
            Item(evaluator, attack.draw(rng), f"{evaluator}:{attack.family}") for attack in picks
        ]
        ctx.send("corpus", ctx.attacker, items, via="stream" if rng.random() < 0.3 else "batch")

    def _modules(self, rng: random.Random) -> None:
        ctx = self.ctx
        cheap = [m for m in self.accepted if not m.heavy]
        heavy = [m for m in self.accepted if m.heavy]
        picks = [rng.choice(cheap) for _ in range(self.profile.modules_items)] if cheap else []
        picks += [rng.choice(heavy) for _ in range(self.profile.modules_heavy)] if heavy else []
        items = [Item(m.name, m.draw_input(rng), m.family) for m in picks]
        results = ctx.send(
            "modules", ctx.attacker, items, via="stream" if rng.random() < 0.3 else "batch"
        )
        for module, (_request, response) in zip(picks, results, strict=True):
            if response is None:
                continue
            outcome = outcome_label(response)
            # deadlines are wall-clock time: a machine that stalls the worker can end any call
            # with deadline_exceeded, so it is always allowed; a value from a loop never is
            if outcome not in module.expected and outcome != "deadline_exceeded":
                kind = "deadline_escape" if module.heavy and outcome == "ok" else "unexpected"
                ctx.recorder.add(
                    [
                        Violation(
                            kind,
                            "modules",
                            f"{module.family}: {outcome}, expected one of "
                            f"{sorted(module.expected)}",
                        )
                    ]
                )
            if module.probe == "memory_pages" and outcome == "ok":
                try:
                    pages = int(response.value)
                except ValueError:
                    ctx.recorder.add(
                        [
                            Violation(
                                "unexpected",
                                "modules",
                                f"memory probe said {response.value[:40]!r}",
                            )
                        ]
                    )
                else:
                    ctx.recorder.add(ctx.checker.memory_pages("modules", ctx.attacker, pages))
        if rng.random() < self.profile.registration_rate:
            self._register_mutated(rng)

    def _register_mutated(self, rng: random.Random) -> None:
        ctx = self.ctx
        client = ctx.client(ctx.attacker)
        if self.refused and rng.random() < 0.3:
            self._register_refused(rng.choice(self.refused), rng)
            return
        bases = [m for m in self.accepted if len(m.wasm) < 64 * 1024]
        if not bases:
            return
        base = rng.choice(bases)
        wasm = mutated_module(base.wasm, rng)
        try:
            info = client.register(wasm)
        except CallError as error:
            code = error.code.value if error.code is not None else None
            ctx.recorder.outcome(
                "modules", f"call:{code or 'unreachable'}", family="register:mutated"
            )
            ctx.recorder.add(
                ctx.checker.call_error(
                    "modules", code, error.message, expected=("invalid_module", "invalid_argument")
                )
            )
            return
        ctx.recorder.outcome("modules", "registered", family="register:mutated")
        if info.name not in {m.name for m in self.accepted}:
            with contextlib.suppress(CallError):
                client.delete(info.name)

    def _protocol(self, rng: random.Random) -> None:
        names = [s[0] for s in protocol.SCENARIOS]
        weights = [s[2] for s in protocol.SCENARIOS]
        index = rng.choices(range(len(names)), weights=weights)[0]
        protocol.SCENARIOS[index][1](self.ctx, rng)

    # Main loop --------------------------------------------------------------------------------

    def _next_class(self, active: set[str]) -> str:
        shares = self.profile.shares
        return min(
            active,
            key=lambda c: (self.recorder.classes[c].inputs + 1) / shares[c],
        )

    def _timed(self, klass: str, step: Callable[[random.Random], None], rng: random.Random) -> None:
        started = time.monotonic()
        try:
            step(rng)
        finally:
            self.recorder.step(klass, time.monotonic() - started)

    def _main_loop(self, progress: Any) -> float:
        settings = self.settings
        budget = settings.input_budget
        deadline = time.monotonic() + settings.seconds if settings.seconds is not None else None
        steps: dict[str, Callable[[random.Random], None]] = {
            "generated": self._generated,
            "corpus": self._corpus,
            "modules": self._modules,
            "protocol": self._protocol,
        }
        quota = {c: budget * self.profile.shares[c] for c in CLASSES}
        start_inputs = {c: self.recorder.classes[c].inputs for c in CLASSES}
        started = time.monotonic()
        inflight: dict[Future[None], str] = {}
        errors: list[BaseException] = []

        def active() -> set[str]:
            if deadline is not None:
                return set(CLASSES) if time.monotonic() < deadline else set()
            return {
                c for c in CLASSES if self.recorder.classes[c].inputs - start_inputs[c] < quota[c]
            }

        def done_inputs() -> int:
            return sum(self.recorder.classes[c].inputs - start_inputs[c] for c in CLASSES)

        with ThreadPoolExecutor(self.profile.lanes, thread_name_prefix="fuzz-lane") as pool:
            while not self.ctx.stop.is_set():
                classes = active()
                while classes and len(inflight) < self.profile.lanes:
                    klass = self._next_class(classes)
                    number = self.step_numbers[klass]
                    self.step_numbers[klass] += 1
                    rng = random.Random(f"{settings.seed}:{klass}:{number}")
                    inflight[pool.submit(self._timed, klass, steps[klass], rng)] = klass
                if not inflight:
                    break
                finished, _ = wait(list(inflight), timeout=0.5, return_when=FIRST_COMPLETED)
                for future in finished:
                    klass = inflight.pop(future)
                    error = future.exception()
                    if error is not None:
                        errors.append(error)
                        self.recorder.add(
                            [Violation("unexpected", klass, f"the step raised {error!r}")]
                        )
                if progress is not None:
                    completed = (
                        time.monotonic() - started if deadline is not None else done_inputs()
                    )
                    progress.update(
                        completed=completed,
                        description=f"fuzz {done_inputs():,} inputs, "
                        f"{self.recorder.violation_total} violations",
                    )
        if errors and self.console is not None:
            self.console.print(f"[yellow]{len(errors)} steps raised; first: {errors[0]!r}")
        return time.monotonic() - started

    # Whole run --------------------------------------------------------------------------------

    def execute(self) -> dict[str, Any]:
        settings = self.settings
        started = time.monotonic()
        monitor: _Monitor | None = None
        report_faults: dict[str, Any] = {"skipped": {}}
        noisy_section: dict[str, Any] = {}
        main_s = 0.0
        exit_status: int | None = None
        try:
            self._say("starting the daemon and registering modules")
            self._setup()
            monitor = _Monitor(self)
            monitor.start()
            if self.ctx.secrets.attacker_loop:
                self._say("noisy neighbour")
                attackers = settings.noisy_attackers or self.ctx.threads
                noisy_section = noisy.measure_noisy_neighbour(
                    self.ctx, samples=self.profile.noisy_samples, attackers=attackers
                )
                if attackers > 1:
                    # the same attack with fewer concurrent calls than the daemon has workers
                    # (what a tenant's max_concurrency below `threads` would enforce)
                    noisy_section["fewer_attackers"] = noisy.measure_noisy_neighbour(
                        self.ctx, samples=self.profile.noisy_samples, attackers=attackers - 1
                    )
                self._say("noisy neighbour: registrations")
                noisy_section["registration"] = noisy.measure_registration_neighbour(
                    self.ctx, samples=self.profile.noisy_samples
                )
            self._say("what a caller can make the daemon hold")
            for scenario in protocol.HOLD_SCENARIOS:
                scenario(self.ctx, random.Random(f"{settings.seed}:hold:{scenario.__name__}"))
            self._say(f"main loop ({settings.budget})")
            main_s = self._run_with_progress()
            if settings.faults and self.daemon is not None and not self.ctx.stop.is_set():
                self._say("kill -9 under load")
                monitor.paused.set()
                try:
                    report_faults["kill9"] = faults.kill_under_load(
                        self.ctx, kill=self._kill, restart=self._restart
                    )
                finally:
                    monitor.paused.clear()
                assert self.root is not None
                self._say("full disk")
                disk, violations = faults.disk_full(
                    self.root / "disk", margin_ms=settings.margin_ms
                )
                report_faults["disk_full"] = disk
                self.recorder.add(violations)
                for case in disk["cases"]:
                    self.recorder.outcome(
                        "fault_disk_full", str(case["outcome"]), family=str(case["case"])
                    )
            elif not settings.faults:
                report_faults["skipped"] = {"kill9": "--no-faults", "disk_full": "--no-faults"}
            else:
                report_faults["skipped"] = {
                    "kill9": "not our daemon (--target)",
                    "disk_full": "not our daemon (--target)",
                }
        finally:
            if monitor is not None:
                monitor.done.set()
                monitor.join(timeout=10)
            with contextlib.suppress(AttributeError):
                self.ctx.close()
            if self.daemon is not None:
                if self.daemon.alive():
                    exit_status = self.daemon.stop(signal.SIGTERM, timeout_s=60)
                    if exit_status != 0:
                        self.recorder.add(
                            [
                                Violation(
                                    "crash", "daemon", f"the daemon exited {exit_status} on SIGTERM"
                                )
                            ]
                        )
            if self.root is not None and not settings.extra.get("keep"):
                shutil.rmtree(self.root, ignore_errors=True)
        return self._report(
            elapsed_s=time.monotonic() - started,
            main_s=main_s,
            monitor=monitor,
            noisy_section=noisy_section,
            report_faults=report_faults,
            exit_status=exit_status,
        )

    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(f"[bold]evald fuzz[/bold]: {text}")

    def _run_with_progress(self) -> float:
        if not self.settings.progress or self.console is None:
            return self._main_loop(None)
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        total = (
            self.settings.seconds
            if self.settings.seconds is not None
            else self.settings.input_budget
        )
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        ) as bar:
            task = bar.add_task("fuzz", total=total)

            class _Updater:
                def update(self, **fields: Any) -> None:
                    bar.update(task, **fields)

            return self._main_loop(_Updater())

    def _report(
        self,
        *,
        elapsed_s: float,
        main_s: float,
        monitor: _Monitor | None,
        noisy_section: dict[str, Any],
        report_faults: dict[str, Any],
        exit_status: int | None,
    ) -> dict[str, Any]:
        settings = self.settings
        recorder = self.recorder
        classes = {
            name: stats.to_json()
            for name, stats in recorder.classes.items()
            if stats.inputs or stats.violations
        }
        counts = recorder.violation_counts
        inputs = sum(s.inputs for s in recorder.classes.values())
        main_inputs = sum(recorder.classes[c].inputs for c in CLASSES)
        typed = sum(s.typed_errors for s in recorder.classes.values())
        from importlib.metadata import version

        ctx = getattr(self, "ctx", None)
        limits = {}
        if ctx is not None:
            for name in (ctx.victim, ctx.attacker):
                bounds = ctx.bounds[name]
                limits["victim" if name == ctx.victim else "attacker"] = {
                    "fuel": bounds.fuel,
                    "deadline_ms": bounds.deadline_ms,
                    "memory_mib": bounds.memory_bytes / 2**20,
                    "input_kib": bounds.input_bytes / 1024,
                    "output_kib": bounds.output_bytes / 1024,
                }
        return {
            "evald_fuzz_report": 1,
            "profile": self.profile.name,
            "seed": settings.seed,
            "budget": settings.budget,
            "elapsed_s": round(elapsed_s, 1),
            "main_loop_s": round(main_s, 1),
            "inputs_per_s": round(main_inputs / main_s, 1) if main_s else 0.0,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "wasmtime": version("wasmtime"),
                "grpcio": version("grpcio"),
            },
            "daemon": {
                "kind": "started by evald fuzz"
                if settings.target is None
                else f"target {settings.target}",
                "threads": ctx.threads if ctx is not None else settings.threads,
                "limits": limits,
                "exit_status_on_sigterm": exit_status,
                "margin_ms": settings.margin_ms,
            },
            "profile_settings": asdict(self.profile),
            "totals": {
                "inputs": inputs,
                "typed_errors": typed,
                "crashes": counts.get("crash", 0),
                "hangs": counts.get("hang", 0),
                "limit_escapes": sum(n for kind, n in counts.items() if kind in LIMIT_ESCAPES),
                "tenant_leaks": counts.get("tenant_leak", 0),
                "violations": sum(counts.values()),
                "by_kind": dict(counts),
                "stalls": sum(s.stalls for s in recorder.classes.values()),
                "max_stall_ms": round(
                    max((s.max_stall_ms for s in recorder.classes.values()), default=0.0), 1
                ),
            },
            "latency": {
                "max_eval_ms": max((s.max_eval_us for s in recorder.classes.values()), default=0)
                / 1000,
                "deadline_overruns": recorder.overruns,
                "worst_overrun_ms": round(recorder.worst_overrun_us / 1000, 2),
                "worst_overrun_deadline_ms": recorder.worst_overrun_deadline_ms,
                "worst_overrun_class": recorder.worst_overrun_class,
                "max_call_ms": round(
                    max((s.max_call_ms for s in recorder.classes.values()), default=0.0), 1
                ),
            },
            "rss": {
                "peak_mib": round((monitor.peak_rss if monitor else 0) / 2**20, 1),
                "bound_mib": settings.rss_bound_bytes / 2**20,
                "samples": monitor.samples if monitor else 0,
                "health_checks": monitor.health_checks if monitor else 0,
            },
            "classes": classes,
            "noisy_neighbour": noisy_section,
            "faults": report_faults,
            "hardening": list(HARDENING),
            "violations": [v.to_json() for v in recorder.violations],
        }


def run_fuzz(settings: FuzzSettings, *, console: Any = None) -> dict[str, Any]:
    """Runs one fuzz run and returns its report (a JSON-able dict).

    Raises:
        ValueError: the settings name a target without its config or tenants.
        RuntimeError: the daemon did not start (the message carries its log).
    """
    return FuzzRun(settings, console=console).execute()
