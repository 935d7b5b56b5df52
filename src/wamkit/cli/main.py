"""`wamkit VERB [config.yaml] [key=value ...]`. Each verb lives in its own module exposing main(argv) -> int.

User errors (unknown keys, envs, policies, bad files) print one line and exit with code 2."""

from __future__ import annotations

import importlib
import sys

from wamkit.core.errors import UserError

VERBS = {
    "eval": ("wamkit.cli.eval_cmd", "evaluate a policy in simulation"),
    "serve": ("wamkit.cli.serve_cmd", "run the action server for a policy"),
    "train": ("wamkit.cli.train_cmd", "fine-tune a policy on a LeRobot v3 dataset (FSDP2)"),
    "export": ("wamkit.cli.export_cmd", "turn a training checkpoint into a servable directory"),
    "data": ("wamkit.cli.data_cmd", "inspect | stats | record LeRobot v3 datasets"),
    "bench": ("wamkit.cli.bench_cmd", "benchmarks (bench eval: the scheduler table)"),
    "report": ("wamkit.cli.report_cmd", "print the per-task table of an evaluation output dir (and draw its timeline)"),
    "demo": ("wamkit.cli.demo_cmd", "the demo: pipelined LIBERO eval, MetaWorld learning loop"),
}


def usage() -> str:
    lines = ["usage: wamkit VERB [config.yaml] [key=value ...]", "", "verbs:"]
    lines += [f"  {v:<8} {h}" for v, (_, h) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"wamkit: unknown verb {verb!r}; valid choices: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(VERBS[verb][0])
        return int(mod.main(rest) or 0)
    except UserError as e:
        print(f"wamkit {verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"wamkit {verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
