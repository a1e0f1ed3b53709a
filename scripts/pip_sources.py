"""Print `uv pip install` options for the package sources pip is configured with (pip.conf files, PIP_* variables).

uv reads no pip configuration, and a host may serve its wheels from its own indexes, folders or constraints.
`make install` passes these options to uv, so that uv installs what pip would.
"""

import ast
import shlex
import subprocess
import sys

SOURCES = ("index-url", "extra-index-url", "find-links", "constraint")  # pip's keys, uv's options of the same names


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    options = {}  # (option, source): None, in pip's order, each once (a source may be set in a file and a variable)
    for line in listing.splitlines():  # e.g. global.extra-index-url='file:///srv/a file:///srv/b'
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        for source in ast.literal_eval(value).split() if name in SOURCES else ():
            options[f"--{name}", source] = None
    print(" ".join(f"{option} {shlex.quote(source)}" for option, source in options))


if __name__ == "__main__":
    main()
