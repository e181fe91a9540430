"""`sapiens2 COMMAND ...`: the one entry point of an installed sapiens2 (also `python -m sapiens2 COMMAND ...`).

Each command is a file at the root of a checkout (predict.py, train.py, export.py, serve.py), installed as
sapiens2/predict.py, ...; `sapiens2 predict ARGS` runs its main(ARGS) and exits with its code, so it takes the same
arguments and gives the same exit codes as `python predict.py ARGS`. The commands are imported only when asked for:
`sapiens2 --help` imports no torch.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "predict": "run the models on your images and videos (python predict.py)",
    "train": "fine-tune a task model on your own data (python train.py)",
    "export": "export a model to ONNX or torch.export, checked against PyTorch (python export.py)",
    "serve": "a local web page: every task on your photos, and an attention explorer (python serve.py)",
}
USAGE_ERROR = 2  # the exit code of a usage error, as argparse's in every command


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return ("usage: sapiens2 COMMAND [ARGS ...]   (sapiens2 COMMAND --help for its arguments)\n\ncommands:\n"
            + "\n".join(lines) + "\n  --version  print the version\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        return 0 if argv else USAGE_ERROR
    if argv[0] in ("-V", "--version"):
        from sapiens2 import __version__
        print(f"sapiens2 {__version__}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"error: sapiens2: no command {name!r}; the commands are {', '.join(COMMANDS)}\n")
        return USAGE_ERROR
    command = importlib.import_module(f"sapiens2.{name}")
    return command.main(args, prog=f"sapiens2 {name}")


if __name__ == "__main__":
    sys.exit(main())
