"""`wamkit VERB [config.yaml] [key=value ...]`. Each verb lives in its own module exposing main(argv) -> int and
help_text(argv) -> str (`wamkit VERB --help`, generated from the verb's config dataclass where it has one).

User errors (unknown keys, envs, policies, bad files) print one line and exit with code 2."""

from __future__ import annotations

import importlib
import sys

from wamkit.core.errors import RunError, UserError

VERBS = {
    "eval": ("wamkit.cli.eval_cmd", "evaluate a policy in simulation"),
    "serve": ("wamkit.cli.serve_cmd", "run the action server for a policy"),
    "train": ("wamkit.cli.train_cmd", "fine-tune a policy on a LeRobot v3 dataset (FSDP2)"),
    "export": ("wamkit.cli.export_cmd", "turn a training checkpoint into a servable directory"),
    "data": ("wamkit.cli.data_cmd", "inspect | stats | record LeRobot v3 datasets"),
    "bench": ("wamkit.cli.bench_cmd", "benchmarks (bench eval: the scheduler table)"),
    "report": ("wamkit.cli.report_cmd", "print the per-task table of an evaluation output dir (and draw its timeline)"),
    "demo": ("wamkit.cli.demo_cmd", "the demo: pipelined LIBERO evaluation, then record -> train -> serve -> eval"),
}
HELP_FLAGS = ("-h", "--help", "help")
# verbs whose work runs in child processes (env workers, servers): SIGTERM unwinds them like Ctrl-C, so every worker
# is stopped and its shared memory freed (serve has uvicorn's own graceful SIGTERM; train runs under torchrun's)
UNWIND_ON_SIGTERM = ("eval", "bench", "data", "demo", "report", "export")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so `finally` blocks run (workers closed, journal flushed)."""


def _on_sigterm(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)      # a second SIGTERM ends the process at once
    raise Terminated()


def drop_terminated(record) -> bool:
    """Logging filter: False for a record that carries Terminated. When SIGTERM lands while asyncio.run's main task
    is itself running, the task ends holding the exception that unwinds the run, and asyncio logs it as 'Task
    exception was never retrieved' (with a traceback) once the task is collected, after the one-line exit message:
    the unwinding is the intended exit, not an error."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, Terminated)


def _unwind_on_sigterm() -> None:
    import logging
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        logging.getLogger("asyncio").addFilter(drop_terminated)


def usage() -> str:
    lines = ["usage: wamkit VERB [config.yaml] [key=value ...]", "       wamkit VERB --help    every key of VERB, "
             "its default, valid choices and meaning", "       wamkit --version", "", "verbs:"]
    lines += [f"  {v:<8} {h}" for v, (_, h) in VERBS.items()]
    return "\n".join(lines)


def version() -> str:
    import wamkit

    return f"wamkit {wamkit.__version__}"


def verb_help(verb: str, rest: list[str]) -> str:
    mod = importlib.import_module(VERBS[verb][0])
    fn = getattr(mod, "help_text", None)
    return fn([a for a in rest if a not in HELP_FLAGS]) if callable(fn) else (mod.__doc__ or "").strip()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in HELP_FLAGS:
        print(usage())
        return 0
    if argv[0] in ("--version", "-V", "version"):
        print(version())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        hint = ""
        if verb.startswith("-"):
            hint = " (the verb comes first, then keys as key=value without dashes: wamkit eval env=libero ...)"
        print(f"wamkit: unknown verb {verb!r}; valid choices: {', '.join(VERBS)}{hint}", file=sys.stderr)
        return 2
    try:
        if any(a in ("-h", "--help") for a in rest) or rest[:1] == ["help"]:
            print(verb_help(verb, rest))
            return 0
        mod = importlib.import_module(VERBS[verb][0])
        if verb in UNWIND_ON_SIGTERM:
            _unwind_on_sigterm()
        return int(mod.main(rest) or 0)
    except UserError as e:
        print(f"wamkit {verb}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"wamkit {verb}: error: {e}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"wamkit {verb}: terminated (SIGTERM); workers stopped", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"wamkit {verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
