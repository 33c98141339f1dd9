"""structlog set up the way its docs advise: contextvars first, JSON to pipes, pretty on a TTY."""

from __future__ import annotations

import importlib.util
import logging
import sys

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(level: str = "info", fmt: str = "auto", service: str | None = None) -> None:
    """Configure structlog (and stdlib logging, which nats/aiohttp use) once per process.

    ``fmt``: "json", "console", or "auto" (console on a TTY, JSON otherwise).
    """
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if use_console:
        # Tracebacks without the frames' local variables: a local may hold a key or a token.
        formatter = (
            structlog.dev.RichTracebackFormatter(show_locals=False)
            if importlib.util.find_spec("rich")
            else structlog.dev.plain_traceback
        )
        renderer: structlog.types.Processor = structlog.dev.ConsoleRenderer(
            exception_formatter=formatter
        )
    else:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=max(_LEVELS[level], logging.INFO),
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    structlog.contextvars.clear_contextvars()
    if service:
        structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = (
        structlog.get_logger(name) if name else structlog.get_logger()
    )
    return logger
