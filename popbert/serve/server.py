"""`popbert serve`: load an export, check the settings, and run the application on uvicorn — in
this process (`workers: 1`), or in N worker processes sharing one port, each with its own copy of
the model and its own socket on the port (SO_REUSEPORT: the kernel spreads the connections); the
settings reach them through the environment, the API key as `POPBERT_API_KEY`, never on a
command line or in a log.

SIGTERM or SIGINT: uvicorn stops accepting, answers every request it accepted, the batcher runs
the rows it holds, and the command returns 0. A second SIGINT stops at once (uvicorn's force
exit) and returns 130, saying so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from popbert.config.sections import ServeConfig
from popbert.errors import ConfigError, UsageError
from popbert.machine import cpu_quota, usable_cpus

log = logging.getLogger(__name__)

API_KEY_ENV = "POPBERT_API_KEY"
SETTINGS_ENV = "POPBERT_SERVE_SETTINGS"  # the model and the serve section, for workers
KEEP_ALIVE_SECONDS = 75
# The exit status of a server (or worker) a second SIGINT stopped at once, without waiting for
# the requests in flight: the shell's status for a command ended by Ctrl-C.
INTERRUPTED = 130


def check_settings(model: Path, config: ServeConfig) -> None:
    """The settings' mistakes as one line each, before anything is loaded."""
    try:
        config.validate()
    except ConfigError as error:
        raise UsageError(str(error)) from None
    for flag, value in (("--ssl-certfile", config.ssl_certfile),
                        ("--ssl-keyfile", config.ssl_keyfile)):
        if value is not None and not Path(value).is_file():
            raise UsageError(f"{flag}: file not found: {value}")
    if not Path(model).exists():
        raise UsageError(f"--model: file not found: {model}")
    if config.served_model_name is not None and not config.served_model_name.strip():
        raise UsageError("--served-model-name: empty; give the name clients send as `model`, "
                         "or leave the flag out for the export's")
    try:
        socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)
    except OSError as error:  # not an address, nor a name that resolves
        raise UsageError(f"--host {config.host}: not an address to listen on "
                         f"({error.strerror or error})") from None


def load(model: Path, config: ServeConfig) -> Any:
    """The export, loaded and checked against the limits (`popbert.serve.routes.Served`)."""
    from popbert.serve.routes import Served

    served = Served(model, config.threads, config.served_model_name, config.max_input_tokens,
                    config.device)
    served.use_default_prompt(config.default_prompt_name, config.default_prompt)
    if config.max_batch_tokens < served.max_input_tokens:
        raise UsageError(f"--max-batch-tokens {config.max_batch_tokens}: a batch must hold one "
                         f"input of the model's length ({served.max_input_tokens} tokens)")
    return served


def serve(model: Path, config: ServeConfig, api_key: str | None = None) -> int:
    """Run the server until SIGTERM or SIGINT; 0 once every accepted request is answered."""
    import uvicorn

    check_settings(model, config)
    config = _threads_shared(config)
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    served = load(model, config)  # a bad export is one line here, before the port is taken
    options: dict[str, Any] = {
        "host": config.host, "port": config.port, "log_config": None,
        "access_log": config.access_log, "timeout_graceful_shutdown": None,
        # Longer than the idle timeout of the load balancers in front (60 s on the common
        # ones), so a kept-alive connection is never closed by the server while a client is
        # about to reuse it (uvicorn's 5 s default makes that race likely under load).
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
        "ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile}
    scheme = "https" if config.ssl_certfile else "http"
    log.info("popbert serve: %s on %s://%s:%d, %d worker%s%s", model, scheme, config.host,
             config.port, config.workers, "" if config.workers == 1 else "s",
             ", API key required" if api_key else "")
    if config.workers == 1:
        from popbert.serve.app import create_app

        try:
            sock = _listening_socket(config.host, config.port, config.client_timeout_s)
        except OSError as error:
            raise _cannot_listen(config, error) from None
        server = uvicorn.Server(uvicorn.Config(create_app(served, config, api_key), **options))
        return _run(server, config, sock)
    del served  # each worker loads its own
    metrics_dir = tempfile.mkdtemp(prefix="popbert-serve-metrics-")
    environment = {SETTINGS_ENV: json.dumps({"model": str(model),
                                             "serve": dataclasses.asdict(config)}),
                   "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    if api_key:
        environment[API_KEY_ENV] = api_key
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        _check_port(config)
        _supervise(config, options)
        log.info("popbert serve: stopped; every worker answered its accepted requests")
        return 0
    except _Interrupted:
        log.warning("popbert serve: stopped at once by a second interrupt; requests in flight "
                    "were not answered")
        return INTERRUPTED
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _threads_shared(config: ServeConfig) -> ServeConfig:
    """Without `threads`, each worker gets its share of the CPUs the server may use
    (`popbert.machine`): left to itself each runtime takes every core of the machine, so N workers
    oversubscribe them N times (2 workers on 2 cores: 14-19% fewer answers, a 35-53% higher
    p95; benchmarks/RESULTS.md), and
    a container limited to fewer CPUs than the machine has is throttled. One worker outside
    such a limit keeps its runtime's own default."""
    if config.threads is not None:
        return config
    quota = cpu_quota()
    if config.workers == 1 and quota is None:
        return config
    cpus = usable_cpus()
    threads = max(1, cpus // config.workers)
    log.info("popbert serve: %d thread%s per worker, %d worker%s (%d CPUs%s; --threads to "
             "choose)", threads, "" if threads == 1 else "s", config.workers,
             "" if config.workers == 1 else "s", cpus,
             f", a CPU quota of {quota:g}" if quota is not None else "")
    return dataclasses.replace(config, threads=threads)


def _listening_socket(host: str, port: int, client_timeout_s: float,
                      shared: bool = False) -> socket.socket:
    """A socket on (host, port); `shared`: with SO_REUSEPORT, so each worker binds its own
    and the kernel spreads new connections across them. (One socket shared by the workers, as
    uvicorn's supervisor does it, lets whichever worker wakes first take a burst of keep-alive
    connections: 32 clients opened at once went nearly all to one of two workers.)
    Its connections inherit TCP_USER_TIMEOUT (Linux): the kernel drops one whose peer has
    taken none of the answer for twice `client_timeout_s` (gone, or not reading), after the
    application gave up on it; that ends uvicorn's own wait to write to it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                            int(2 * client_timeout_s * 1000))
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Interrupted(Exception):
    """A worker was stopped at once by a second interrupt."""


def _check_port(config: ServeConfig) -> None:
    """The port taken by anything else is one line before any worker starts. The check binds
    without SO_REUSEPORT, so another server's workers on the port count as taken (they would
    otherwise silently share its connections), as these workers do for the next one."""
    if config.port == 0:
        raise UsageError("--port 0: with --workers above 1 every worker must listen on the "
                         "same port; give one")
    try:
        _listening_socket(config.host, config.port, config.client_timeout_s).close()
    except OSError as error:
        raise _cannot_listen(config, error) from None


def _worker(options: dict[str, Any], client_timeout_s: float) -> None:
    """One worker process: its own socket on the shared port, the app from the environment."""
    import uvicorn

    sock = _listening_socket(options["host"], options["port"], client_timeout_s, shared=True)
    config = uvicorn.Config("popbert.serve.server:app_from_environment", factory=True,
                            **options)
    server = uvicorn.Server(config)
    with _quiet_signals():  # stopped by a signal: exit 0, not re-raised
        server.run(sockets=[sock])
    if server.force_exit:
        raise SystemExit(INTERRUPTED)


def _supervise(config: ServeConfig, options: dict[str, Any]) -> None:
    """Start `config.workers` worker processes; on SIGTERM or SIGINT stop them gracefully (each
    answers what it accepted) and return. A worker that dies on its own stops the rest."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker, args=(options, config.client_timeout_s),
                               name=f"popbert-serve-{n}") for n in range(config.workers)]
    stop = threading.Event()

    def on_signal(sig: int, _: Any) -> None:
        if stop.is_set() and sig == signal.SIGINT:  # a second interrupt: stop at once
            for worker in workers:
                if worker.is_alive() and worker.pid is not None:
                    os.kill(worker.pid, signal.SIGINT)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for worker in workers:
            worker.start()
        while not stop.wait(0.5):
            dead = [worker for worker in workers if not worker.is_alive()]
            if dead:
                stop.set()
                log.error("worker %s exited (%s); stopping the others", dead[0].name,
                          dead[0].exitcode)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()  # SIGTERM: uvicorn's graceful stop
        for worker in workers:
            worker.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if any(worker.exitcode == INTERRUPTED for worker in workers):
        raise _Interrupted
    failed = [worker for worker in workers if worker.exitcode != 0]
    if failed:
        raise UsageError(f"--workers {config.workers}: worker {failed[0].name} failed "
                         f"(exit {failed[0].exitcode}); its log is above")


def _run(server: Any, config: ServeConfig, sock: socket.socket) -> int:
    with _quiet_signals():
        try:
            server.run(sockets=[sock])
        except SystemExit:  # uvicorn exits 1 when it cannot start (e.g. the TLS files)
            raise UsageError(f"--port {config.port}: the server did not start on "
                             f"{config.host}:{config.port}; its log is above") from None
        finally:
            sock.close()
    if not server.started:
        raise UsageError(f"--port {config.port}: the server did not start on "
                         f"{config.host}:{config.port}")
    if server.force_exit:
        log.warning("popbert serve: stopped at once by a second interrupt; requests in flight "
                    "were not answered")
        return INTERRUPTED
    log.info("popbert serve: stopped; every accepted request was answered")
    return 0


def _cannot_listen(config: ServeConfig, error: OSError) -> UsageError:
    return UsageError(f"--port {config.port}: cannot listen on {config.host}:{config.port} "
                      f"({error.strerror or error})")


class _quiet_signals:
    """While uvicorn runs, SIGTERM and SIGINT are its (a graceful stop); the signal it raises
    again once stopped lands here and is dropped, so a stopped server exits 0."""

    def __enter__(self) -> None:
        self.previous = {sig: signal.signal(sig, lambda *_: None)
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def app_from_environment() -> Any:
    """A worker's application (`--workers N`): the settings from `POPBERT_SERVE_SETTINGS`,
    the key from `POPBERT_API_KEY`."""
    from popbert.serve.app import create_app

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    logging.getLogger("popbert").addHandler(handler)
    logging.getLogger("popbert").setLevel(logging.INFO)
    settings = json.loads(os.environ[SETTINGS_ENV])
    config = ServeConfig(**settings["serve"])
    served = load(Path(settings["model"]), config)
    return create_app(served, config, os.environ.get(API_KEY_ENV) or None, multiprocess=True)


__all__ = ["API_KEY_ENV", "app_from_environment", "check_settings", "load", "serve"]
